//! What the benches that run real agents share: the release `bcd` beside the bench's
//! `better-compute` (checked to be a current `fakehw` build), `better-compute dev` as a child with
//! the agents' endpoint on a given port, and a child a panic does not leave running.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use super::banner;

/// The `bcd` beside the bench's `better-compute` (the same profile directory): it must be a
/// `fakehw` build and no older than its sources (its dep-info, as the e2e harness checks).
pub fn bcd() -> PathBuf {
    let path = Path::new(env!("CARGO_BIN_EXE_better-compute")).with_file_name("bcd");
    let hint = "hint: cargo build --release -p bc-agent --features fakehw --bin bcd (make bench does)";
    assert!(path.exists(), "{} is not built\n{hint}", path.display());
    let built = std::fs::metadata(&path).and_then(|m| m.modified()).unwrap();
    let dep_info = std::fs::read_to_string(path.with_extension("d")).unwrap_or_default();
    let sources = dep_info.lines().next().and_then(|l| l.split_once(": ")).map(|(_, s)| s.replace("\\ ", "\u{0}"));
    let newer = sources
        .iter()
        .flat_map(|s| s.split_whitespace())
        .map(|s| PathBuf::from(s.replace('\u{0}', " ")))
        .find(|s| std::fs::metadata(s).and_then(|m| m.modified()).is_ok_and(|changed| changed > built));
    assert!(newer.is_none(), "{} is older than {}\n{hint}", path.display(), newer.unwrap().display());
    let fake = Command::new(&path).args(["hardware", "--fake-hw", "1"]).stdout(Stdio::null()).stderr(Stdio::null()).status();
    assert!(fake.is_ok_and(|s| s.success()), "{} is not a fakehw build\n{hint}", path.display());
    path
}

/// `better-compute dev` as a child: (child, http url, agents serving pin, log key pin).
pub fn start_gateway(dir: &Path, agents_port: u16) -> (Child, String, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_better-compute"))
        .args(["dev", "--data-dir", &dir.display().to_string(), "--listen", "127.0.0.1:0"])
        .args(["--agents-listen", &format!("127.0.0.1:{agents_port}")])
        // Every simulated machine connects from 127.0.0.1: the cap per peer address is lifted.
        .args(["--agents-connections-per-peer-max", "65536"])
        // The tenants' calls measure placement, not the per-key rate limit.
        .args(["--rate-per-key", "0", "--rate-per-tenant", "0"])
        .env("BETTER_COMPUTE_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (url, serving_pin, log_pin) = banner::read(child.stdout.take().unwrap());
    (child, url, serving_pin, log_pin)
}

/// A child process that a panic of the bench does not leave running: killed when dropped.
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
