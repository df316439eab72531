//! `audit follow` against a live `dev`: it follows new entries as they are sealed, keeps its
//! state in a 0600 file, and reports an edited event (a payload byte changed in the database)
//! and a forked checkpoint with the tenant and the index or size, exit 3.

use bc_tests::{Server, cli};
use serde_json::{Value, json};

async fn pools(server: &Server, prefix: &str, n: usize) {
    for chunk in (0..n).collect::<Vec<_>>().chunks(25) {
        futures::future::join_all(chunk.iter().map(|i| server.call("pools.create", json!({ "name": format!("{prefix}{i}") }))))
            .await;
    }
}

fn seal(server: &Server) -> u64 {
    let (code, out, err) = cli(&["audit", "checkpoint", "--data-dir", server.data_dir.to_str().unwrap()], &[]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    v["sealed"][0]["treeSize"].as_u64().unwrap()
}

async fn canonical_of(server: &Server, tenant: &str, seq: u64) -> Vec<u8> {
    use sqlx::Row;
    let url = format!("sqlite://{}", server.sqlite_path().display());
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    let row =
        sqlx::query(sqlx::AssertSqlSafe(format!("SELECT canonical FROM events WHERE tenant_id = '{tenant}' AND seq = {seq}")))
            .fetch_one(&pool)
            .await
            .unwrap();
    let bytes: Vec<u8> = row.get(0);
    pool.close().await;
    bytes
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test]
async fn follow_a_live_log_and_catch_an_edit_and_a_fork() {
    let server = Server::dev_with(&["--no-reconcilers"]);
    let tenant = bc_core::id::TenantId::ROOT.to_string();
    let (_, pki, _) = cli(&["pki", "show", "--data-dir", server.data_dir.to_str().unwrap()], &[]);
    let pin = serde_json::from_str::<Value>(&pki).unwrap()["pin"].as_str().unwrap().to_owned();
    let auditor = tempfile::tempdir().unwrap();
    let state = auditor.path().join("follow.json");
    let follow = || {
        cli(
            &["audit", "follow", &server.url, "--pin", &pin, "--state", state.to_str().unwrap(), "--once"],
            &[("BETTER_COMPUTE_TOKEN", &server.token)],
        )
    };

    pools(&server, "a", 300).await;
    let first = seal(&server);
    let (code, out, err) = follow();
    assert_eq!(code, 0, "{err}");
    let summary: Value = serde_json::from_str(&out).unwrap();
    assert_eq!((summary["size"].as_u64(), summary["checked"].as_u64()), (Some(first), Some(first)), "{summary}");
    assert!(err.contains("fetched leaves 256..") && err.contains("checked"), "progress is printed: {err}");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&state).unwrap().permissions().mode() & 0o777, 0o600);
    let (code, out, _) = follow();
    assert_eq!((code, serde_json::from_str::<Value>(&out).unwrap()["checked"].as_u64()), (0, Some(0)), "nothing new");

    // New entries, sealed: followed from where it stopped.
    pools(&server, "b", 20).await;
    let second = seal(&server);
    let (code, out, err) = follow();
    assert_eq!(code, 0, "{err}");
    assert_eq!(serde_json::from_str::<Value>(&out).unwrap()["checked"].as_u64(), Some(second - first));

    // A payload byte edited in the database after sealing: named by tenant and index.
    pools(&server, "c", 5).await;
    let third = seal(&server);
    let seq = second + 2;
    let canonical = canonical_of(&server, &tenant, seq).await;
    let mut edited = canonical.clone();
    // `name: "cN"`: the text `name`, a one-byte head, `c`, then the digit to change.
    let at = edited.windows(6).position(|w| w == b"name\x62c").expect("the pool's name is in the payload");
    edited[at + 6] = if edited[at + 6] == b'9' { b'8' } else { b'9' };
    server.sql(&format!("UPDATE events SET canonical = X'{}' WHERE tenant_id = '{tenant}' AND seq = {seq}", hex(&edited))).await;
    let saved = std::fs::read(&state).unwrap();
    let (code, _, err) = follow();
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("\nAUDIT_BAD_ENTRY: "), "{err}");
    assert!(err.contains(&tenant) && err.contains(&format!("index {}", seq - 1)), "{err}");
    assert_eq!(std::fs::read(&state).unwrap(), saved, "a refused round leaves the state as it was");

    // Put the byte back: the log checks again and the follower catches up.
    server
        .sql(&format!("UPDATE events SET canonical = X'{}' WHERE tenant_id = '{tenant}' AND seq = {seq}", hex(&canonical)))
        .await;
    let (code, _, err) = follow();
    assert_eq!(code, 0, "{err}");

    // A forked checkpoint: the size already seen, another root, signed by the real key.
    let key = bc_core::keys::LogKey::load(&server.data_dir.join("log.key")).unwrap();
    let body = bc_core::note::CheckpointBody {
        origin: bc_core::note::origin_of("better-compute", &bc_core::id::TenantId::ROOT),
        size: third,
        root: [7; 32],
    };
    let forked = bc_core::note::sign_note(&body.encode(), "better-compute", &key).unwrap();
    let doc = json!({ "treeSize": third, "note": forked, "seq": third + 1, "sealedAtMs": 0 }).to_string();
    server
        .sql(&format!(
            "UPDATE projections SET doc = '{}' WHERE tenant_id = '{tenant}' AND kind = 'checkpoint' AND id = '{}'",
            doc.replace('\'', "''"),
            bc_core::audit::checkpoint_row_id(third)
        ))
        .await;
    let (code, _, err) = follow();
    assert_eq!(code, 3, "{err}");
    assert!(err.starts_with("AUDIT_FORK: ") && err.contains(&tenant) && err.contains(&format!("size {third}")), "{err}");
}
