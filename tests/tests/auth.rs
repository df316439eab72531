//! `auth login/status/logout`: a token from standard input, checked, saved 0600 atomically, used
//! only for the deployment it was saved for, and never printed.

use std::os::unix::fs::PermissionsExt;

use bc_tests::{Server, cli_stdin};
use serde_json::Value;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn login_saves_a_private_profile_used_only_for_its_url() {
    let server = Server::dev();
    let dir = tempfile::tempdir().unwrap();
    let creds = dir.path().join("conf").join("credentials.json");
    let creds_s = creds.to_str().unwrap();
    let env = [("BETTER_COMPUTE_CREDENTIALS", creds_s)];

    // A token is never an argument; a wrong one is refused and nothing is saved.
    let (code, _, err) = cli_stdin(&["auth", "login", "--url", &server.url, &server.token], &env, None);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = cli_stdin(&["auth", "login", "--url", &server.url], &env, Some("key_01m8md8t2hsbztp95s8efzj87k.nope\n"));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("UNAUTHENTICATED"), "{err}");
    assert!(!creds.exists(), "a refused token is not saved");

    let (code, out, err) = cli_stdin(&["auth", "login", "--url", &server.url], &env, Some(&format!("{}\n", server.token)));
    assert_eq!(code, 0, "{err}");
    assert!(!out.contains(&server.token), "login never prints the token: {out}");
    let saved: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(saved["profile"], "default");
    assert_eq!(saved["tenantId"], "ten_00000000000000000000000000");
    assert_eq!(std::fs::metadata(&creds).unwrap().permissions().mode() & 0o777, 0o600);
    assert_eq!(std::fs::metadata(creds.parent().unwrap()).unwrap().permissions().mode() & 0o777, 0o700);
    let leftovers: Vec<_> = std::fs::read_dir(creds.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(leftovers.len(), 1, "no temporary file left behind: {leftovers:?}");

    // Commands now find it, for this URL only.
    let (code, out, err) = cli_stdin(&["api", "system.whoami", "--url", &server.url], &env, None);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("ten_00000000000000000000000000"));
    let (code, _, err) = cli_stdin(&["api", "system.whoami", "--url", "http://127.0.0.1:9"], &env, None);
    assert_eq!(code, 1);
    assert!(err.starts_with("MISSING_ENV"), "a saved token goes only to its own deployment: {err}");
    let (code, out, _) = cli_stdin(&["auth", "status", "--url", &server.url], &env, None);
    assert_eq!(code, 0);
    assert!(out.contains("\"source\": \"profile\"") && !out.contains(&server.token), "{out}");
    // The environment comes first.
    let (code, out, _) = cli_stdin(&["auth", "status", "--url", &server.url], &[env[0], ("BETTER_COMPUTE_TOKEN", "x.y")], None);
    assert_eq!(code, 0);
    assert!(out.contains("BETTER_COMPUTE_TOKEN") && !out.contains("x.y"), "{out}");

    // A second profile, from the environment, unverified; then logout.
    let (code, _, err) = cli_stdin(
        &["auth", "login", "--url", "https://compute.example.com", "--profile", "ci", "--no-verify"],
        &[env[0], ("BETTER_COMPUTE_TOKEN", "key_x.secret")],
        None,
    );
    assert_eq!(code, 0, "{err}");
    let (code, out, _) = cli_stdin(&["auth", "logout", "--profile", "ci"], &env, None);
    assert_eq!((code, out.contains("\"removed\": true")), (0, true), "{out}");
    let (code, _, _) = cli_stdin(&["auth", "logout"], &env, None);
    assert_eq!(code, 0);
    let (code, _, err) = cli_stdin(&["api", "system.whoami", "--url", &server.url], &env, None);
    assert_eq!(code, 1);
    assert!(err.starts_with("MISSING_ENV"), "{err}");
    // A broken file is a clear error, not a crash.
    std::fs::write(&creds, "{not json").unwrap();
    let (code, _, err) = cli_stdin(&["api", "system.whoami", "--url", &server.url], &env, None);
    assert_eq!(code, 1);
    assert!(err.contains("INVALID_CREDENTIALS"), "{err}");
}
