//! The client's token policy: plain `http://` only on the loopback names, refused
//! before any connection, and no redirect ever followed, so a token never crosses a network in
//! clear text nor reaches an address it was not given to.
//!
//! A refusal is by the host as written, so the tests point refused URLs at a listener the test
//! owns and assert nothing reached it: `127.0.0.2` (routed to this machine, but not one of the
//! names the policy allows) proves the CLI did not connect where it could have, and
//! `notlocal.test` is the name from the issue. Absence is checked only after a probe connection,
//! made after the CLI exited, has been accepted: the listener accepts in arrival order, so any
//! connection of the CLI would have been seen first.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bc_tests::{Server, cli, cli_stdin};

/// The first bytes of the probe connection: not an HTTP request, so never taken for the CLI's.
const PROBE: &[u8] = b"PROBE\r\n\r\n";
/// How long the listener waits for a connection's request head.
const READ_TIMEOUT_S: u64 = 5;
/// How long a test waits for its probe to be accepted.
const PROBE_TIMEOUT_S: u64 = 20;

/// A listener that records the request head of every connection and answers each with `answer`
/// (or closes it without a word).
struct Recorder {
    addr: SocketAddr,
    heads: Arc<Mutex<Vec<Vec<u8>>>>,
}

impl Recorder {
    fn start(ip: &str, answer: Option<String>) -> Recorder {
        let listener = TcpListener::bind((ip, 0)).expect("bind the recorder");
        let addr = listener.local_addr().expect("addr");
        let heads = Arc::new(Mutex::new(Vec::new()));
        let seen = heads.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let head = read_head(&mut stream);
                if head != PROBE
                    && let Some(answer) = &answer
                {
                    let _ = stream.write_all(answer.as_bytes());
                }
                seen.lock().unwrap().push(head);
            }
        });
        Recorder { addr, heads }
    }

    /// Every connection's head before the probe, once the probe has been accepted.
    fn connections_before_probe(&self) -> Vec<String> {
        let mut probe = TcpStream::connect(self.addr).expect("probe connect");
        probe.write_all(PROBE).expect("probe write");
        let deadline = Instant::now() + Duration::from_secs(PROBE_TIMEOUT_S);
        loop {
            {
                let heads = self.heads.lock().unwrap();
                if let Some(at) = heads.iter().position(|h| h == PROBE) {
                    return heads[..at].iter().map(|h| String::from_utf8_lossy(h).into_owned()).collect();
                }
            }
            assert!(Instant::now() < deadline, "the probe was not accepted within {PROBE_TIMEOUT_S}s");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Reads up to the end of the request head (or EOF, or the timeout).
fn read_head(stream: &mut TcpStream) -> Vec<u8> {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(READ_TIMEOUT_S)));
    let mut head = Vec::new();
    let mut buffer = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 64 * 1024 {
        match stream.read(&mut buffer) {
            Ok(0) | Err(_) => break,
            Ok(n) => head.extend_from_slice(&buffer[..n]),
        }
    }
    head
}

const TOKEN: &str = "key_01m8md8t2hsbztp95s8efzj87k.secret-that-must-not-travel";

fn assert_refused_as_plain_http(code: i32, err: &str) {
    assert_eq!(code, 2, "a plain-http URL off loopback is a usage error: {err}");
    assert!(err.contains("INVALID_ARGUMENT"), "{err}");
    assert!(err.contains("plain http is only for loopback"), "{err}");
    assert!(err.contains("https://"), "the hint says to use https: {err}");
}

#[test]
fn plain_http_off_loopback_is_refused_before_any_connection() {
    let recorder = Recorder::start("127.0.0.2", None);
    let port = recorder.addr.port();
    for host in ["127.0.0.2", "notlocal.test"] {
        let url = format!("http://{host}:{port}");
        let (code, _, err) = cli(&["pools", "list"], &[("BETTER_COMPUTE_URL", &url), ("BETTER_COMPUTE_TOKEN", TOKEN)]);
        assert_refused_as_plain_http(code, &err);
        let (code, _, err) = cli(&["pools", "list", "--url", &url], &[("BETTER_COMPUTE_TOKEN", TOKEN)]);
        assert_refused_as_plain_http(code, &err);
        let (code, _, err) = cli(&["events", "watch"], &[("BETTER_COMPUTE_URL", &url), ("BETTER_COMPUTE_TOKEN", TOKEN)]);
        assert_refused_as_plain_http(code, &err);

        let dir = tempfile::tempdir().unwrap();
        let creds = dir.path().join("credentials.json");
        let env = [("BETTER_COMPUTE_CREDENTIALS", creds.to_str().unwrap())];
        let (code, _, err) = cli_stdin(&["auth", "login", "--url", &url], &env, Some(&format!("{TOKEN}\n")));
        assert_refused_as_plain_http(code, &err);
        let (code, _, err) = cli_stdin(&["auth", "login", "--no-verify", "--url", &url], &env, Some(&format!("{TOKEN}\n")));
        assert_refused_as_plain_http(code, &err);
        assert!(!creds.exists(), "nothing is saved for a refused URL");
    }
    let seen = recorder.connections_before_probe();
    assert!(seen.is_empty(), "the CLI connected to a refused URL: {seen:?}");
}

#[test]
fn plain_http_on_loopback_names_is_allowed() {
    let server = Server::dev();
    let port = server.url.rsplit(':').next().unwrap();
    for url in [format!("http://127.0.0.1:{port}"), format!("http://localhost:{port}")] {
        let (code, out, err) =
            cli(&["pools", "list", "--format", "json", "--url", &url], &[("BETTER_COMPUTE_TOKEN", &server.token)]);
        assert_eq!(code, 0, "{url}: {err}");
        assert!(out.contains("items"), "{url}: {out}");

        let dir = tempfile::tempdir().unwrap();
        let creds = dir.path().join("credentials.json");
        let env = [("BETTER_COMPUTE_CREDENTIALS", creds.to_str().unwrap())];
        let (code, out, err) = cli_stdin(&["auth", "login", "--url", &url], &env, Some(&format!("{}\n", server.token)));
        assert_eq!(code, 0, "{url}: {err}");
        assert!(out.contains("ten_00000000000000000000000000"), "{url}: {out}");
    }
}

#[test]
fn a_redirect_is_reported_and_never_followed() {
    let elsewhere = Recorder::start("127.0.0.1", None);
    let answer = format!(
        "HTTP/1.1 307 Temporary Redirect\r\nlocation: http://{}/api/compute/pools.list\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
        elsewhere.addr
    );
    let redirector = Recorder::start("127.0.0.1", Some(answer));
    let url = format!("http://{}", redirector.addr);
    let env = [("BETTER_COMPUTE_URL", url.as_str()), ("BETTER_COMPUTE_TOKEN", TOKEN)];

    let (code, _, err) = cli(&["pools", "list"], &env);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("307") && err.contains("follows no redirects"), "the 307 is the error: {err}");
    let (code, _, err) = cli(&["events", "watch"], &env);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("307") && err.contains("follows no redirects"), "the watch stops on the 307: {err}");

    let asked = redirector.connections_before_probe();
    assert_eq!(asked.len(), 2, "the CLI asked the URL it was given, once per command: {asked:?}");
    let followed = elsewhere.connections_before_probe();
    assert!(followed.is_empty(), "the redirect was followed: {followed:?}");
}
