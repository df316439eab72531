//! One etcd member for the benches that measure against etcd (`watch`, `api_writes`):
//! Debian's `etcd-server` (`make bench` installs it), or the binary `BC_BENCH_ETCD` names,
//! started afresh in a temp directory on loopback ports of its own.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One etcd member in a temp directory, on loopback ports of its own; killed when dropped.
pub struct EtcdServer {
    child: Child,
    _dir: tempfile::TempDir,
}

/// The etcd binary: `BC_BENCH_ETCD`, or `etcd` on `PATH`.
fn etcd_binary() -> String {
    std::env::var("BC_BENCH_ETCD").unwrap_or_else(|_| "etcd".to_owned())
}

/// `etcd --version`'s first line, or why there is none.
pub fn etcd_version() -> String {
    match Command::new(etcd_binary()).arg("--version").output() {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).lines().next().unwrap_or("").trim().to_owned(),
        Ok(out) => panic!("{} --version failed: {}", etcd_binary(), String::from_utf8_lossy(&out.stderr)),
        Err(e) => panic!(
            "cannot run {}: {e}\nhint: make bench installs Debian's etcd-server (scripts/bench-deps), or set BC_BENCH_ETCD",
            etcd_binary()
        ),
    }
}

/// A loopback port nothing listens on now (bound and released: another process could take it
/// before etcd does, which this bench does not guard against).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl EtcdServer {
    pub async fn start() -> (String, Self) {
        let dir = tempfile::tempdir().unwrap();
        let (client, peer) = (free_port(), free_port());
        let client_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let log = std::fs::File::create(dir.path().join("etcd.log")).unwrap();
        let child = Command::new(etcd_binary())
            .args(["--name", "bench", "--data-dir"])
            .arg(dir.path().join("data"))
            .args(["--listen-client-urls", &client_url, "--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("bench={peer_url}"), "--log-level", "error"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", etcd_binary()));
        let server = Self { child, _dir: dir };
        let http = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(r) = http.get(format!("{client_url}/health")).send().await
                && r.status().is_success()
                && r.text().await.unwrap_or_default().contains("true")
            {
                break;
            }
            assert!(Instant::now() < deadline, "etcd did not become healthy on {client_url}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        (client_url, server)
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
