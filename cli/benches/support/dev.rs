//! A `better-compute dev` child a bench starts (this package's release binary) on a fresh data
//! directory, and the wait for it: its port open and its admin token written.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The admin token once `port` accepts connections and `token_path` holds it; panics after 60 s.
pub fn wait_ready(port: u16, token_path: &Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let up = std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
        if up && let Ok(token) = std::fs::read_to_string(token_path) {
            return token.trim().to_owned();
        }
        assert!(Instant::now() < deadline, "better-compute dev did not start; see its log");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A port free on loopback now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `better-compute dev` on loopback ports with the rate limits off (a bench measures what the
/// server carries, not a per-key limit) and `extra` flags, its log in `server.log` of its
/// directory; killed when dropped.
pub struct Dev {
    child: Child,
    #[allow(dead_code)] // Not every bench reads it.
    pub port: u16,
    pub url: String,
    pub token: String,
    pub dir: tempfile::TempDir,
}

impl Dev {
    pub fn start(extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (port, agents) = (free_port(), free_port());
        let log = std::fs::File::create(dir.path().join("server.log")).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_better-compute"))
            .args(["dev", "--data-dir"])
            .arg(dir.path().join("data"))
            .args(["--listen", &format!("127.0.0.1:{port}"), "--agents-listen", &format!("127.0.0.1:{agents}")])
            .args(["--rate-per-key", "0", "--rate-per-tenant", "0"])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let token_path = dir.path().join("data").join("admin.token");
        // Owned before the wait, so a server that never comes up is killed as the bench panics.
        let mut dev = Self { child, port, url: format!("http://127.0.0.1:{port}"), token: String::new(), dir };
        dev.token = wait_ready(port, &token_path);
        dev
    }

    /// Its data directory (`--data-dir`).
    #[allow(dead_code)] // Not every bench reads it.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }
}

impl Drop for Dev {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
