//! Waiting for a `better-compute dev` child a bench started: its port open and its admin token
//! written.

use std::path::Path;
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
