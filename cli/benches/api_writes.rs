//! `make bench` (api_writes), goal 6a: writes through the API against etcd's puts
//! through its v3 JSON gateway, both driven by the same load generator, wrk (Debian's `wrk`,
//! which `make bench` installs), at 64 and 256 connections in the same run.
//!
//! Ours: `better-compute dev` as its own process (this package's release binary) on a fresh
//! SQLite database (`synchronous = FULL`), reconcilers on as a user runs it; each request is
//! `pools.create` with a name of its own, so each is a signed, chained, projected event
//! committed before the answer. etcd: one member with its defaults (its WAL fsynced), each
//! request a `POST /v3/kv/put` of a key of its own and a value about as long as our event.
//! wrk runs 2 threads for `WRK_DURATION_S` per cell, the cells interleaved (etcd 64, ours 64,
//! etcd 256, ours 256) so a noisy minute hits both, for `ROUNDS` rounds; every answer must be
//! 2xx (a cell with any other answer stops the bench). The goal: ours ÷ etcd's requests per
//! second ≥ 1.0 at each connection count, judged on the median of the rounds' ratios (one
//! round's ratio moved by ±0.15 from run to run on this kind of machine, both sides' rates
//! swinging by a quarter).

use std::path::Path;

use crate::support::dev;
use crate::support::etcd;
use crate::support::wrk;
use etcd::{EtcdServer, etcd_version};
use wrk::Cell;

/// How long wrk drives each cell.
const WRK_DURATION_S: u64 = 10;
/// wrk's threads (the machine has 2 cores, shared with the server under test).
const WRK_THREADS: u32 = 2;
const CONNECTIONS: [u32; 2] = [64, 256];
/// Rounds of the four cells.
const ROUNDS: usize = 3;
/// The value etcd stores per put: about as long as our `pool.created` event's envelope.
const ETCD_VALUE_BYTES: usize = 246;
const _: () = assert!(ETCD_VALUE_BYTES.is_multiple_of(3), "so its base64 has no padding to get wrong");

/// The wrk script for ours: a `pools.create` with a name unique per thread and request.
const OURS_LUA: &str = r#"
function request()
  counter = counter + 1
  local body = string.format('{"name":"w%d-%d"}', tid, counter)
  return wrk.format("POST", "/api/compute/pools.create", nil, body)
end
"#;

/// The wrk script for etcd: a put of a key unique per thread and request. Keys are base64 of
/// `bench/` and then digits (any run of base64 characters whose length is a multiple of 4
/// decodes), so no encoder is needed in Lua.
const ETCD_LUA: &str = r#"
function request()
  counter = counter + 1
  local key = string.format("YmVuY2gv%02d%010d", tid, counter)
  local body = string.format('{"key":"%s","value":"%s"}', key, VALUE)
  return wrk.format("POST", "/v3/kv/put", nil, body)
end
"#;

/// Runs wrk against `url` with `script` (its `VALUE` and headers set first) and reads its report.
fn wrk(url: &str, script: &str, headers: &[(&str, &str)], connections: u32, dir: &Path) -> Cell {
    let mut lua = String::new();
    lua.push_str(&format!("VALUE = \"{}\"\n", "QUJD".repeat(ETCD_VALUE_BYTES / 3)));
    lua.push_str("wrk.headers[\"Content-Type\"] = \"application/json\"\n");
    for (name, value) in headers {
        lua.push_str(&format!("wrk.headers[\"{name}\"] = \"{value}\"\n"));
    }
    lua.push_str(wrk::THREAD_IDS_LUA);
    lua.push_str(script);
    wrk::run(url, &lua, WRK_THREADS, connections, WRK_DURATION_S, dir)
}

pub fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let scripts = tempfile::tempdir().unwrap();
    eprintln!("api_writes: better-compute dev against {}, wrk {WRK_DURATION_S} s per cell", etcd_version());
    let ours = dev::Dev::start(&[]);
    let (etcd_url, _etcd) = runtime.block_on(EtcdServer::start());
    let bearer = format!("Bearer {}", ours.token);
    let mut rows = Vec::new();
    for round in 1..=ROUNDS {
        for connections in CONNECTIONS {
            eprintln!("  round {round}, {connections} connections: etcd…");
            let etcd = wrk(&etcd_url, ETCD_LUA, &[], connections, scripts.path());
            eprintln!("  round {round}, {connections} connections: ours…");
            let mine = wrk(&ours.url, OURS_LUA, &[("Authorization", &bearer)], connections, scripts.path());
            rows.push((round, connections, mine, etcd));
        }
    }
    println!();
    println!("| round | connections | ours writes/s | p50 / p99 ms | etcd puts/s | p50 / p99 ms | ours ÷ etcd |");
    println!("|------:|------------:|--------------:|-------------:|------------:|-------------:|------------:|");
    for (round, connections, mine, etcd) in &rows {
        println!(
            "| {round:>5} | {connections:>11} | {:>13.0} | {:>5.1} / {:<5.1} | {:>11.0} | {:>5.1} / {:<5.1} | {:>11.2} |",
            mine.requests_per_s,
            mine.p50_ms,
            mine.p99_ms,
            etcd.requests_per_s,
            etcd.p50_ms,
            etcd.p99_ms,
            mine.requests_per_s / etcd.requests_per_s
        );
    }
    println!("goal 6a: writes through the API >= etcd's puts through its JSON gateway (median of {ROUNDS} rounds)");
    for connections in CONNECTIONS {
        let mut ratios: Vec<f64> = rows
            .iter()
            .filter(|(_, c, _, _)| *c == connections)
            .map(|(_, _, mine, etcd)| mine.requests_per_s / etcd.requests_per_s)
            .collect();
        ratios.sort_by(f64::total_cmp);
        let median = ratios[ratios.len() / 2];
        let each: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
        println!(
            "  {connections} connections: {median:.2} (rounds: {})  {}",
            each.join(", "),
            if median >= 1.0 { "met" } else { "MISSED" }
        );
    }
}
