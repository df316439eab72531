//! `better-compute support-bundle` and `bcd support-bundle` end to end: against a real `dev` and a
//! real `bcd node` joined to it, each binary makes a bundle, which `tar` unpacks; every file of
//! it is searched for every secret of the data directories (the log key, the data key, the
//! agents' TLS key, the admin token; the node's key), the join token, the API token in the
//! environment and a database URL's password, each in every form it could take (as stored, its
//! raw bytes, hex, base64 standard and URL-safe, a PEM's lines and DER): none may appear. The
//! logs handed to the bundles have those secrets planted in them, so a bundle that only left
//! files out would still fail. A bundle is 0600; one over an existing file is refused
//! (`ALREADY_EXISTS`, exit 1; bcd: exit 1) and the file is left as it was.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use bc_tests::{AgentNode, cli, wait_until};
use serde_json::{Value, json};

/// Every form a secret's `bytes` could be written in.
fn forms_of_bytes(bytes: &[u8], out: &mut Vec<Vec<u8>>) {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    out.push(bytes.to_vec());
    out.push(hex::encode(bytes).into_bytes());
    out.push(hex::encode_upper(bytes).into_bytes());
    for engine in [&STANDARD, &STANDARD_NO_PAD, &URL_SAFE, &URL_SAFE_NO_PAD] {
        out.push(engine.encode(bytes).into_bytes());
    }
}

/// A secret held as text (a token, a hex key, a password): the text, and its decoded bytes.
fn forms_of_text(text: &str, out: &mut Vec<Vec<u8>>) {
    let text = text.trim();
    out.push(text.as_bytes().to_vec());
    if let Ok(bytes) = hex::decode(text) {
        forms_of_bytes(&bytes, out);
    }
    if let Ok(bytes) = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(text) {
        forms_of_bytes(&bytes, out);
    }
    if let Some((_, secret)) = text.split_once('.') {
        forms_of_text(secret, out);
    }
}

/// A PEM private key: the file, each line of its body, the DER and its encodings.
fn forms_of_pem(pem: &str, out: &mut Vec<Vec<u8>>) {
    out.push(pem.as_bytes().to_vec());
    let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
    for line in pem.lines().filter(|l| !l.starts_with("-----") && l.len() >= 16) {
        out.push(line.as_bytes().to_vec());
    }
    out.push(body.as_bytes().to_vec());
    forms_of_bytes(&base64::engine::general_purpose::STANDARD.decode(&body).expect("a PEM body"), out);
}

/// Unpacks `bundle` with `tar` into a new directory: every file's path and bytes.
fn unpack(bundle: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = tempfile::tempdir().unwrap();
    let status = std::process::Command::new("tar").arg("-xzf").arg(bundle).arg("-C").arg(dir.path()).status().unwrap();
    assert!(status.success(), "tar -xzf {}", bundle.display());
    let mut files = Vec::new();
    let mut pending = vec![dir.path().to_path_buf()];
    while let Some(at) = pending.pop() {
        for entry in std::fs::read_dir(&at).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
            } else {
                let relative = path.strip_prefix(dir.path()).unwrap().to_path_buf();
                files.push((relative, std::fs::read(&path).unwrap()));
            }
        }
    }
    files.sort();
    files
}

/// Fails naming the file and the secret's form when one appears in any file.
fn assert_no_secret(files: &[(PathBuf, Vec<u8>)], secrets: &[(String, Vec<Vec<u8>>)]) {
    for (path, bytes) in files {
        for (what, forms) in secrets {
            for form in forms.iter().filter(|f| f.len() >= 8) {
                assert!(
                    !bytes.windows(form.len()).any(|w| w == form.as_slice()),
                    "{what} is in {} as {:?}",
                    path.display(),
                    String::from_utf8_lossy(form)
                );
            }
        }
    }
}

fn file<'a>(files: &'a [(PathBuf, Vec<u8>)], name: &str) -> &'a [u8] {
    files
        .iter()
        .find(|(p, _)| p.ends_with(name))
        .map(|(_, b)| b.as_slice())
        .unwrap_or_else(|| panic!("no {name} in {:?}", files.iter().map(|(p, _)| p).collect::<Vec<_>>()))
}

fn json_file(files: &[(PathBuf, Vec<u8>)], name: &str) -> Value {
    serde_json::from_slice(file(files, name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

/// The data directory's secrets, by file.
fn control_plane_secrets(data_dir: &Path) -> Vec<(String, Vec<Vec<u8>>)> {
    let mut secrets = Vec::new();
    for name in ["log.key", "data.key", "admin.token"] {
        let text = std::fs::read_to_string(data_dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut forms = Vec::new();
        forms_of_text(&text, &mut forms);
        forms.push(text.into_bytes());
        secrets.push((name.to_owned(), forms));
    }
    let pem = std::fs::read_to_string(data_dir.join("agents-tls.key")).unwrap();
    let mut forms = Vec::new();
    forms_of_pem(&pem, &mut forms);
    secrets.push(("agents-tls.key".to_owned(), forms));
    secrets
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bundles_of_dev_and_of_a_joined_bcd_hold_no_secret() {
    let (server, port) = bc_tests::agents_gateway();
    let pool = server.pool("bundle").await;
    let (status, created) = server.call("joinTokens.create", json!({ "poolId": pool, "uses": 1 })).await;
    assert_eq!(status, 200, "{created}");
    let join_token = created["token"].as_str().unwrap().to_owned();
    let mut node = AgentNode::new(&server, port);
    let (code, out, err) = node.join_stdin(&join_token);
    assert_eq!(code, 0, "bcd join: {out} {err}");
    node.start();
    wait_until("bcd node's session is live", Duration::from_secs(30), || {
        node.status().filter(|s| s["session"] == "live").map(|_| ())
    });
    let work = tempfile::tempdir().unwrap();
    let password = "Pg-Passw0rd-Of-The-Deployment";
    let admin_token = server.token.clone();

    let mut secrets = control_plane_secrets(&server.data_dir);
    let mut forms = Vec::new();
    forms_of_text(&join_token, &mut forms);
    secrets.push(("the join token".into(), forms));
    secrets.push(("the database password".into(), vec![password.as_bytes().to_vec()]));
    let node_key = std::fs::read_to_string(node.data().join("node.key")).unwrap();
    let mut forms = Vec::new();
    forms_of_text(&node_key, &mut forms);
    secrets.push(("node.key".into(), forms));

    // The server's log, and the secrets planted in it: a line that leaked them is scrubbed.
    let log = work.path().join("server.log");
    let mut text = server.log_text();
    for name in ["admin.token", "log.key", "data.key", "agents-tls.key"] {
        text.push_str(&format!("leaked {name}: {}\n", std::fs::read_to_string(server.data_dir.join(name)).unwrap()));
    }
    text.push_str(&format!("leaked url: postgres://bc:{password}@db/bc\n"));
    std::fs::write(&log, text).unwrap();
    // A configuration file, shown redacted.
    let config = work.path().join("better-compute.toml");
    std::fs::write(&config, format!("listen = \"127.0.0.1:7070\"\ndata-dir = {:?}\n", server.data_dir.display().to_string()))
        .unwrap();

    // The control plane's bundle, with the admin token in the environment.
    let out = work.path().join("control-plane.tar.gz");
    let data_dir = server.data_dir.display().to_string();
    let args = [
        "support-bundle",
        "--out",
        out.to_str().unwrap(),
        "--data-dir",
        &data_dir,
        "--log-file",
        log.to_str().unwrap(),
        "--config",
        config.to_str().unwrap(),
    ];
    let (code, stdout, stderr) = cli(&args, &[("BETTER_COMPUTE_TOKEN", &admin_token)]);
    assert_eq!(code, 0, "support-bundle: {stdout} {stderr}");
    assert_eq!(mode(&out), 0o600);
    let files = unpack(&out);
    assert_no_secret(&files, &secrets);
    // What it holds: the doctor's checks (a healthy dev: none fails), the reconcilers, the
    // listing with the keys' modes, the configuration, the log's lines with the leaks scrubbed.
    let doctor = json_file(&files, "doctor.json");
    let checks = doctor.as_array().unwrap();
    assert!(checks.iter().any(|c| c["name"] == "log-key" && c["status"] == "ok"), "{doctor}");
    assert!(checks.iter().all(|c| c["status"] != "fail"), "{doctor}");
    let reconcilers = json_file(&files, "reconcilers.json");
    assert!(reconcilers["items"].as_array().is_some_and(|i| !i.is_empty()), "{reconcilers}");
    let listing = json_file(&files, "data-dir.json");
    let entry = |name: &str| listing["entries"].as_array().unwrap().iter().find(|e| e["path"] == name).cloned();
    assert_eq!(entry("admin.token").unwrap()["mode"], "0600", "{listing}");
    assert_eq!(entry("data.key").unwrap()["mode"], "0600", "{listing}");
    let settings = json_file(&files, "config.json");
    assert_eq!(settings["configFile"]["settings"]["listen"], "127.0.0.1:7070", "{settings}");
    assert!(settings["configFile"]["note"].is_null(), "the file's data-dir is the one read: {settings}");
    assert_eq!(settings["environment"]["BETTER_COMPUTE_TOKEN"], "[REDACTED]", "{settings}");
    let logged = String::from_utf8_lossy(file(&files, "logs/better-compute.log")).into_owned();
    assert!(logged.contains("leaked admin.token: [REDACTED]"), "{logged}");
    assert!(logged.contains("postgres://bc:[REDACTED]@db/bc"), "{logged}");
    assert!(logged.lines().count() > 5, "{logged}");
    let versions = json_file(&files, "versions.json");
    assert_eq!(versions["build"]["logFormat"], 1, "{versions}");
    assert!(versions["host"]["kernel"].is_string(), "{versions}");

    // The same deployment named by a PostgreSQL URL with a password: the URL is shown without it.
    let url = format!("postgres://bc:{password}@127.0.0.1:1/bc");
    let out_pg = work.path().join("postgres.tar.gz");
    let (code, stdout, stderr) =
        cli(&["support-bundle", "--out", out_pg.to_str().unwrap(), "--data-dir", &data_dir, "--database-url", &url], &[]);
    assert_eq!(code, 0, "support-bundle --database-url: {stdout} {stderr}");
    let files = unpack(&out_pg);
    assert_no_secret(&files, &secrets);
    assert_eq!(json_file(&files, "config.json")["database"]["url"], "postgres://bc:[REDACTED]@127.0.0.1:1/bc");

    // Never over an existing file: refused with its code, the file as it was.
    let before = std::fs::read(&out).unwrap();
    let (code, _, stderr) = cli(&["support-bundle", "--out", out.to_str().unwrap(), "--data-dir", &data_dir], &[]);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.starts_with("ALREADY_EXISTS: "), "{stderr}");
    assert_eq!(std::fs::read(&out).unwrap(), before);

    // The node's bundle, with the join token in BCD_JOIN_TOKEN (taken out of the environment at
    // start) and a log holding the node's key and the token.
    let node_log = work.path().join("bcd.log");
    std::fs::write(&node_log, format!("{}leaked node.key: {node_key}leaked token: {join_token}\n", node.node_log())).unwrap();
    let out = work.path().join("node.tar.gz");
    let config = node.config();
    let args = ["support-bundle", "--config", &config, "--out", out.to_str().unwrap(), "--log-file", node_log.to_str().unwrap()];
    let (code, stdout, stderr) = node.bcd(&args, &[("BCD_JOIN_TOKEN", &join_token)], None);
    assert_eq!(code, 0, "bcd support-bundle: {stdout} {stderr}");
    assert_eq!(mode(&out), 0o600);
    let files = unpack(&out);
    assert_no_secret(&files, &secrets);
    let doctor = json_file(&files, "doctor.json");
    assert!(doctor.as_array().unwrap().iter().any(|c| c["name"] == "identity" && c["status"] == "ok"), "{doctor}");
    assert_eq!(json_file(&files, "status.json")["session"], "live");
    let settings = json_file(&files, "config.json");
    assert_eq!(settings["loads"], true, "{settings}");
    assert!(settings["settings"]["log_key_pin"].as_str().is_some_and(|p| p.starts_with("sha256/")), "{settings}");
    let listing = json_file(&files, "data-dir.json");
    assert!(listing["entries"].as_array().unwrap().iter().any(|e| e["path"] == "node.key" && e["mode"] == "0600"), "{listing}");
    let logged = String::from_utf8_lossy(file(&files, "logs/bcd.log")).into_owned();
    assert!(logged.contains("leaked node.key: [REDACTED]") && logged.contains("leaked token: [REDACTED]"), "{logged}");

    let before = std::fs::read(&out).unwrap();
    let (code, _, stderr) = node.bcd(&["support-bundle", "--config", &config, "--out", out.to_str().unwrap()], &[], None);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("exists; a support bundle is never written over a file"), "{stderr}");
    assert_eq!(std::fs::read(&out).unwrap(), before);
}
