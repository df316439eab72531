//! `audit follow` across `pki rotate-log-key`, for a tenant other than the root: a monitor holding
//! only the old pin, with a key that reads only that tenant (not the root chain the rotation is
//! in), learns the new key from `GET /audit/{tenant}/rotations` (the `log_key.rotated` event the
//! old key signed, proved in a root checkpoint the old key signed) and follows on; a rotation
//! the old key did not sign (its signature changed in the database) is refused.

use bc_tests::{Server, cli};
use serde_json::{Value, json};

fn json_of(out: &str) -> Value {
    serde_json::from_str(out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

fn seal(server: &Server) {
    let (code, _, err) = cli(&["audit", "checkpoint", "--data-dir", server.data_dir.to_str().unwrap()], &[]);
    assert_eq!(code, 0, "{err}");
}

/// One `audit follow --once` of `tenant` with `token`, trusting only `pin`.
fn follow(server: &Server, tenant: &str, token: &str, pin: &str, state: &std::path::Path) -> (i32, String, String) {
    cli(
        &["audit", "follow", &server.url, "--tenant", tenant, "--pin", pin, "--state", state.to_str().unwrap(), "--once"],
        &[("BETTER_COMPUTE_TOKEN", token)],
    )
}

async fn rotation_sig(server: &Server) -> Vec<u8> {
    use sqlx::Row;
    let url = format!("sqlite://{}", server.sqlite_path().display());
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    let row = sqlx::query("SELECT sig FROM events WHERE tenant_id = ? AND type = 'log_key.rotated'")
        .bind(bc_core::id::TenantId::ROOT.to_string())
        .fetch_one(&pool)
        .await
        .unwrap();
    let sig: Vec<u8> = row.get(0);
    pool.close().await;
    sig
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

async fn pools(server: &Server, tenant: &str, prefix: &str, n: usize) {
    for i in 0..n {
        let (status, pool) = server.call("pools.create", json!({ "tenantId": tenant, "name": format!("{prefix}{i}") })).await;
        assert_eq!(status, 200, "{pool}");
    }
}

#[tokio::test]
async fn a_tenant_monitor_with_only_the_old_pin_follows_a_rotation_and_refuses_a_forged_one() {
    let mut server = Server::dev_with(&["--no-reconcilers"]);
    let data_dir = server.data_dir.to_str().unwrap().to_owned();
    let acme = server.tenant("acme").await;
    let (status, key) =
        server.call("apiKeys.create", json!({ "tenantId": acme, "name": "monitor", "actions": ["compute:events:read"] })).await;
    assert_eq!(status, 200, "{key}");
    let monitor = key["token"].as_str().unwrap().to_owned();
    let old_pin = json_of(&cli(&["pki", "show", "--data-dir", &data_dir], &[]).1)["pin"].as_str().unwrap().to_owned();

    pools(&server, &acme, "before", 5).await;
    seal(&server);
    let auditor = tempfile::tempdir().unwrap();
    let state = auditor.path().join("acme.json");
    let (code, out, err) = follow(&server, &acme, &monitor, &old_pin, &state);
    assert_eq!(code, 0, "{err}");
    let before = json_of(&out)["size"].as_u64().unwrap();
    assert!(before >= 5, "{out}");
    // The monitor's key cannot read the root tenant, where the rotation is.
    let root = bc_core::id::TenantId::ROOT.to_string();
    let (code, _, err) = follow(&server, &root, &monitor, &old_pin, &auditor.path().join("root.json"));
    assert_ne!(code, 0, "{err}");
    assert!(err.contains("403") || err.contains("ACCESS_DENIED"), "{err}");

    let rotated = server.rotate_log_key_offline();
    let new_pin = rotated["pin"].as_str().unwrap().to_owned();
    assert_ne!(new_pin, old_pin);
    pools(&server, &acme, "after", 3).await;
    seal(&server);
    let served = server
        .http
        .get(format!("{}/audit/{acme}/checkpoint", server.url))
        .bearer_auth(&monitor)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let after: u64 = served.lines().nth(1).unwrap().parse().unwrap();
    assert!(after >= before + 3, "{served}");

    // Forged (after sealing, which would refuse it): the rotation's signature is not the old key's.
    server.stop();
    let sig = rotation_sig(&server).await;
    let mut forged = sig.clone();
    forged[0] ^= 1;
    let root_sql = format!("UPDATE events SET sig = X'{{}}' WHERE tenant_id = '{root}' AND type = 'log_key.rotated'");
    server.sql(&root_sql.replace("{}", &hex(&forged))).await;
    server.restart();

    let saved = std::fs::read(&state).unwrap();
    let (code, _, err) = follow(&server, &acme, &monitor, &old_pin, &state);
    assert_eq!(code, 1, "a rotation the old key did not sign vouches for nothing: {err}");
    assert!(
        err.contains("INVALID_PROOF") && err.contains("key rotation 1") && err.contains("not signed by the old key"),
        "{err}"
    );
    assert!(err.contains(&acme), "the tenant is named: {err}");
    assert_eq!(std::fs::read(&state).unwrap(), saved, "a refused round leaves the state as it was");
    let (code, _, err) = follow(&server, &acme, &monitor, &old_pin, &auditor.path().join("fresh-forged.json"));
    assert_eq!(code, 1, "{err}");

    // The rotation as the old key signed it: followed with the old pin alone.
    server.stop();
    server.sql(&root_sql.replace("{}", &hex(&sig))).await;
    server.restart();
    let (code, out, err) = follow(&server, &acme, &monitor, &old_pin, &state);
    assert_eq!(code, 0, "{err}");
    let summary = json_of(&out);
    assert_eq!((summary["checked"].as_u64(), summary["rotatedKeys"].as_u64()), (Some(after - before), Some(1)), "{summary}");
    assert!(err.contains("learned 1 rotated log key"), "{err}");
    let kept = json_of(&std::fs::read_to_string(&state).unwrap());
    assert_eq!(kept["rotatedKeys"].as_array().unwrap().len(), 1, "the new key is kept: {kept}");
    // Next round: the kept key suffices, nothing is learned again.
    pools(&server, &acme, "later", 2).await;
    seal(&server);
    let (code, out, err) = follow(&server, &acme, &monitor, &old_pin, &state);
    assert_eq!(code, 0, "{err}");
    let later = json_of(&out);
    assert!(later["checked"].as_u64().unwrap() >= 2, "{later}");
    assert!(!err.contains("learned"), "{err}");
    // A monitor starting after the rotation, from the old pin: events of both keys check.
    let (code, out, err) = follow(&server, &acme, &monitor, &old_pin, &auditor.path().join("fresh.json"));
    assert_eq!(code, 0, "{err}");
    let fresh = json_of(&out);
    assert_eq!((fresh["checked"].as_u64(), fresh["size"].as_u64()), (later["size"].as_u64(), later["size"].as_u64()), "{fresh}");
}
