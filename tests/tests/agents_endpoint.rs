//! `dev` and `serve` serve the agents' endpoint beside the HTTP API: TLS with a serving
//! certificate made at first start (its key 0600) whose pin is printed and stays across
//! restarts; h2c only in `dev` and only on loopback; the lease flags checked.

use std::os::unix::fs::PermissionsExt;

use bc_gateway::agents::tls::{SERVING_CERT_FILE, SERVING_KEY_FILE, ServingIdentity};
use bc_tests::{Server, cli};

#[tokio::test]
async fn dev_serves_the_agents_endpoint_over_tls_with_a_stable_pin() {
    let mut server = Server::dev();
    let pin = server.agents_pin.clone().expect("TLS by default");
    assert!(server.agents_addr.starts_with("127.0.0.1:") && !server.agents_addr.ends_with(":0"), "{}", server.agents_addr);
    assert_eq!(server.agents_url(), format!("https://{}", server.agents_addr));
    let mode = std::fs::metadata(server.data_dir.join(SERVING_KEY_FILE)).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the serving key is private");
    let on_disk =
        ServingIdentity::load(&server.data_dir.join(SERVING_CERT_FILE), &server.data_dir.join(SERVING_KEY_FILE)).unwrap();
    assert_eq!(on_disk.pin, pin, "the printed pin is the certificate's");
    tokio::net::TcpStream::connect(&server.agents_addr).await.expect("the agents' endpoint accepts connections");

    let addr = server.agents_addr.clone();
    server.restart();
    assert_eq!(server.agents_pin.as_deref(), Some(pin.as_str()), "the certificate is kept across restarts");
    assert_eq!(server.agents_addr, addr, "a restart binds the same address");
}

#[tokio::test]
async fn given_certificate_files_are_served_and_h2c_is_dev_and_loopback_only() {
    // A certificate made elsewhere, given by flags.
    let elsewhere = tempfile::tempdir().unwrap();
    let (made, _) = ServingIdentity::load_or_create(elsewhere.path(), &[]).unwrap();
    let (cert, key) = (elsewhere.path().join(SERVING_CERT_FILE), elsewhere.path().join(SERVING_KEY_FILE));
    let server = Server::dev_with(&["--agents-tls-cert", cert.to_str().unwrap(), "--agents-tls-key", key.to_str().unwrap()]);
    assert_eq!(server.agents_pin.as_deref(), Some(made.pin.as_str()));
    assert!(!server.data_dir.join(SERVING_KEY_FILE).exists(), "none is made when one is given");
    drop(server);

    let plain = Server::dev_with(&["--agents-insecure-h2c"]);
    assert_eq!(plain.agents_pin, None);
    assert_eq!(plain.agents_url(), format!("http://{}", plain.agents_addr));
    drop(plain);

    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().display().to_string();
    let refused: &[(&[&str], &str)] = &[
        (&["--agents-insecure-h2c", "--agents-listen", "0.0.0.0:0"], "loopback"),
        (&["--agents-tls-cert", "/nonexistent/c.pem"], "--agents-tls-key"),
        (&["--node-lease", "10s", "--node-heartbeat", "5s"], "--node-heartbeat"),
        (&["--node-lease", "0s"], "zero"),
        (&["--agents-listen", "somewhere"], "HOST:PORT"),
    ];
    for (extra, says) in refused {
        let mut args = vec!["dev", "--data-dir", &data_dir, "--listen", "127.0.0.1:0"];
        args.extend_from_slice(extra);
        let (code, out, err) = cli(&args, &[]);
        assert_eq!(code, 2, "{extra:?} is a usage error: {out}{err}");
        assert!(err.contains(says), "{extra:?} says {says}: {err}");
    }
    let args = ["serve", "--database-url", "postgres://nowhere/x", "--agents-insecure-h2c", "--data-dir", &data_dir];
    let (code, _, err) = cli(&args, &[]);
    assert_eq!(code, 2, "serve takes no h2c: {err}");
}
