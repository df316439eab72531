//! What a `better-compute dev` the bench started prints on its standard output before it serves:
//! the API's URL, the agents' endpoint's serving pin and the log key's pin (`fleet`, `tunnels`).

use std::io::BufRead;

/// Reads the banner up to the agents' line, then drains the rest on a thread of its own (so
/// the child never blocks on a full pipe). Returns the URL, the serving pin and the log pin.
pub fn read(stdout: std::process::ChildStdout) -> (String, String, String) {
    let mut lines = std::io::BufReader::new(stdout).lines();
    let (mut url, mut serving_pin, mut log_pin) = (String::new(), String::new(), String::new());
    for line in lines.by_ref() {
        let line = line.unwrap();
        if let Some(u) = line.strip_prefix("better-compute listening on ") {
            url = u.trim().to_owned();
        }
        if let Some(key) = line.trim_start().strip_prefix("log key:") {
            log_pin = key.split_whitespace().nth(1).unwrap_or_default().to_owned();
        }
        if line.trim_start().starts_with("agents:") {
            serving_pin = line.split("pin ").nth(1).map(|p| p.trim_end_matches(')').trim().to_owned()).unwrap_or_default();
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    assert!(!url.is_empty() && !serving_pin.is_empty() && !log_pin.is_empty(), "the gateway did not print its addresses");
    (url, serving_pin, log_pin)
}
