//! wrk (Debian's `wrk`, which `make bench` installs through scripts/bench-deps) run once against
//! a URL with a Lua script, its report read back: requests per second and latency percentiles.

use std::path::Path;
use std::process::Command;

/// What a wrk script that writes starts with: a request counter per thread and each thread's
/// number (`tid`), so every request's name or key is its own.
pub const THREAD_IDS_LUA: &str = r#"
local counter = 0
local threads = 0
function setup(thread)
  thread:set("tid", threads)
  threads = threads + 1
end
"#;

/// What one wrk run measured.
pub struct Cell {
    pub requests_per_s: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

fn wrk_binary() -> String {
    std::env::var("BC_BENCH_WRK").unwrap_or_else(|_| "wrk".to_owned())
}

/// A latency as wrk prints it (`1.23ms`, `456.78us`, `1.02s`) in milliseconds.
fn wrk_ms(text: &str) -> f64 {
    let (number, scale) = if let Some(n) = text.strip_suffix("us") {
        (n, 0.001)
    } else if let Some(n) = text.strip_suffix("ms") {
        (n, 1.0)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1000.0)
    } else {
        panic!("a wrk latency: {text:?}")
    };
    number.parse::<f64>().unwrap_or_else(|_| panic!("a wrk latency: {text:?}")) * scale
}

/// Runs wrk with `threads` threads and `connections` connections for `duration_s` against
/// `url` with the Lua `script` (written under `dir`), and reads its report. Every answer must be
/// 2xx and no socket may fail: a run with either panics.
pub fn run(url: &str, script: &str, threads: u32, connections: u32, duration_s: u64, dir: &Path) -> Cell {
    let path = dir.join(format!("script-{connections}.lua"));
    std::fs::write(&path, script).unwrap();
    let out = Command::new(wrk_binary())
        .args(["-t", &threads.to_string(), "-c", &connections.to_string(), "-d", &format!("{duration_s}s")])
        .args(["--latency", "--timeout", "10s", "-s"])
        .arg(&path)
        .arg(url)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run {}: {e}\nhint: make bench installs Debian's wrk (scripts/bench-deps)", wrk_binary())
        });
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "wrk failed: {text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(!text.contains("Non-2xx or 3xx responses"), "answers other than 2xx from {url}: {text}");
    assert!(!text.contains("Socket errors"), "socket errors against {url}: {text}");
    let field = |prefix: &str| -> String {
        text.lines()
            .find_map(|l| l.trim().strip_prefix(prefix).map(|rest| rest.split_whitespace().next().unwrap_or("").to_owned()))
            .unwrap_or_else(|| panic!("no {prefix:?} in wrk's report: {text}"))
    };
    Cell { requests_per_s: field("Requests/sec:").parse().unwrap(), p50_ms: wrk_ms(&field("50%")), p99_ms: wrk_ms(&field("99%")) }
}
