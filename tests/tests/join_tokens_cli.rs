//! `join-tokens` and `commands` from the command line against a real `dev`: the secret is
//! printed once or written to a new 0600 file (never over one, refused before the call),
//! `revoke` refuses a pasted secret without sending or echoing it, and commands go only to
//! nodes that joined with `bcd`.

use std::os::unix::fs::PermissionsExt;

use bc_tests::{Server, json};

fn tokens(server: &Server) -> Vec<serde_json::Value> {
    let (code, out, err) = server.cli(&["join-tokens", "list", "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    json(&out)["items"].as_array().cloned().unwrap()
}

#[tokio::test]
async fn a_join_token_secret_goes_to_a_new_private_file_once_and_revoke_refuses_a_secret() {
    let server = Server::dev();
    let pool = server.pool("gpu-a").await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("join.token");
    let path = file.to_str().unwrap();

    let (code, out, err) =
        server.cli(&["join-tokens", "create", "--pool", &pool, "--expires", "2h", "--uses", "3", "--out", path]);
    assert_eq!(code, 0, "{err}");
    let shown = json(&out);
    let id = shown["joinTokenId"].as_str().unwrap().to_owned();
    assert!(id.starts_with("jt_"), "{out}");
    assert_eq!(shown["tokenFile"], path);
    let secret = std::fs::read_to_string(&file).unwrap().trim().to_owned();
    assert!(secret.starts_with("bcjt_"), "the file holds the token");
    assert!(!out.contains(&secret) && !err.contains(&secret), "the secret is only in the file");
    assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o600);

    // Never over an existing file, refused before anything is created.
    let (code, out, err) = server.cli(&["join-tokens", "create", "--pool", &pool, "--out", path]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.starts_with("ALREADY_EXISTS: "), "{err}");
    assert_eq!(std::fs::read_to_string(&file).unwrap().trim(), secret, "the file is untouched");
    assert_eq!(tokens(&server).len(), 1, "no token was made for nothing");

    // Without --out the secret is printed, once.
    let (code, out, err) = server.cli(&["join-tokens", "create", "--pool", &pool, "--description", "rack 4"]);
    assert_eq!(code, 0, "{err}");
    let printed = json(&out);
    assert!(printed["token"].as_str().unwrap().starts_with("bcjt_"), "{out}");
    assert_eq!(printed["description"], "rack 4");

    // list and get never show a secret.
    let (code, table, err) = server.cli(&["join-tokens", "list"]);
    assert_eq!(code, 0, "{err}");
    for header in ["ID", "POOL", "STATE", "USES", "EXPIRES"] {
        assert!(table.contains(header), "{table}");
    }
    assert!(table.contains(&id) && table.contains("0/3") && table.contains("active"), "{table}");
    assert!(!table.contains("bcjt_"), "{table}");
    let (code, out, err) = server.cli(&["join-tokens", "get", &id]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&out)["usesMax"], 3);
    assert!(!out.contains("bcjt_"), "{out}");

    // A pasted secret is refused without being sent or echoed.
    let calls_before = server.last_commit().await;
    for command in ["revoke", "get"] {
        let (code, out, err) = server.cli(&["join-tokens", command, &secret]);
        assert_eq!(code, 2, "{command}: {out}{err}");
        assert!(err.contains("secret"), "{err}");
        assert!(!out.contains(&secret) && !err.contains(&secret), "{command} never echoes the secret: {err}");
        assert!(!err.contains(secret.trim_start_matches("bcjt_")), "nor a part of it: {err}");
    }
    assert_eq!(server.last_commit().await, calls_before);
    let log = std::fs::read_to_string(server.data_dir.join("server.log")).unwrap();
    assert!(!log.contains(&secret), "the secret reached no server log line");

    // Revoked by its id.
    let (code, out, err) = server.cli(&["join-tokens", "revoke", &id]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&out)["state"], "revoked");

    // Ids are checked before anything is sent.
    let (code, _, err) = server.cli(&["join-tokens", "revoke", "pool_01"]);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = server.cli(&["join-tokens", "create", "--pool", "gpu-a"]);
    assert_eq!(code, 2, "{err}");
}

#[tokio::test]
async fn commands_go_only_to_nodes_that_joined() {
    let server = Server::dev();
    let pool = server.pool("gpu-a").await;
    let (code, out, err) =
        server.cli(&["nodes", "register", "--pool", &pool, "--name", "by-hand", "--gpu", "H100:H100-SXM5-80GB:80:0"]);
    assert_eq!(code, 0, "{err}");
    let node = json(&out)["nodeId"].as_str().unwrap().to_owned();

    let (code, out, err) = server.cli(&["commands", "issue", "--node", &node, "ping", "--deadline", "30s"]);
    assert_ne!(code, 0, "{out}");
    assert!(err.contains("no agent") && err.contains("bcd join"), "{err}");
    let (code, table, err) = server.cli(&["commands", "list", "--node", &node]);
    assert_eq!(code, 0, "{err}");
    assert!(table.contains("(no rows)"), "nothing was issued: {table}");

    // Usage mistakes, before anything is sent.
    let refused: &[&[&str]] = &[
        &["commands", "issue", "--node", &node, "ping", "--args", "not json"],
        &["commands", "issue", "--node", &node, "ping", "--args", "[1]"],
        &["commands", "issue", "--node", "pool_01", "ping"],
        &["commands", "issue", "--node", &node, "ping", "--deadline", "0s"],
        &["commands", "get", "node_01"],
        &["commands", "cancel", "rsv_01"],
        &["commands", "list", "--node", "cmd_01"],
    ];
    for args in refused {
        let (code, out, err) = server.cli(args);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
    }
    let (code, _, err) = server.cli(&["commands", "get", "cmd_01jz0000000000000000000000"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.starts_with("NOT_FOUND"), "{err}");
}
