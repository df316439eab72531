//! `make bench` (ha_writes), issue 60: the write rate through two gateways on the recipe's
//! high-availability cluster against one gateway on one plain PostgreSQL, in the same run.
//!
//! The cluster is `scripts/ha-up`'s (etcd, three PostgreSQL members under Patroni, synchronous
//! and strict, two `serve` processes on the members' multi-host URL, HAProxy in front), every
//! process this package's release `better-compute`. The baseline is one PostgreSQL of the same
//! installed version (`initdb`, its defaults, `synchronous_commit = on` with no standby: a
//! commit is on one machine's disk) and one `serve` on it. Both on loopback ports from 25900
//! (never the machine's own 5432, which other people's tests use).
//!
//! wrk drives `pools.create` (each a signed, chained, projected event committed before the
//! answer) with 2 threads and 64 connections for `WRK_DURATION_S` a cell, the cells interleaved
//! (cluster, plain; plain, cluster; …) for `ROUNDS` rounds, judged on the median of the rounds'
//! ratios. Every answer must be 2xx. No goal is set: the figure is what running highly available
//! costs in writes a second (a synchronous standby's round trip in every commit, HAProxy in the
//! path, two gateways on two shared cores). The failover's write gap is not measured here: the
//! HA test (`make test-ha`, tests/tests/ha.rs) reports it over its three kills.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::wrk;
use wrk::Cell;

const WRK_DURATION_S: u64 = 10;
const WRK_THREADS: u32 = 2;
const CONNECTIONS: u32 = 64;
const ROUNDS: usize = 3;
/// The cluster's ports (`HA_PORT_BASE`); the plain PostgreSQL and its gateway take +60..+62.
const BASE: u16 = 25900;

const LUA: &str = r#"
function request()
  counter = counter + 1
  local body = string.format('{"name":"w%d-%d"}', tid, counter)
  return wrk.format("POST", "/api/compute/pools.create", nil, body)
end
"#;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn binary() -> &'static str {
    env!("CARGO_BIN_EXE_better-compute")
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout == b"0\n")
}

/// `program` as the postgres user when this runs as root (PostgreSQL refuses root).
fn as_postgres(program: &Path) -> Command {
    if is_root() {
        let mut command = Command::new("setpriv");
        command.args(["--reuid=postgres", "--regid=postgres", "--init-groups"]).arg(program);
        command
    } else {
        Command::new(program)
    }
}

fn wait_for(what: &str, timeout: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !check() {
        assert!(Instant::now() < deadline, "{what} did not happen within {timeout:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The cluster `scripts/ha-up` brings up in `dir`; `scripts/ha-down` when dropped.
struct Cluster {
    dir: PathBuf,
}

impl Cluster {
    fn up(dir: &Path) -> (Cluster, String, String) {
        let output = Command::new(root().join("scripts/ha-up"))
            .env("HA_DIR", dir)
            .env("HA_PORT_BASE", BASE.to_string())
            .env("HA_TTL", "10")
            .env("HA_LOOP_WAIT", "2")
            .env("HA_RETRY_TIMEOUT", "4")
            .env("BETTER_COMPUTE_BIN", binary())
            .output()
            .expect("scripts/ha-up");
        let cluster = Cluster { dir: dir.to_owned() };
        assert!(output.status.success(), "ha-up failed: {}", String::from_utf8_lossy(&output.stderr));
        let env = std::fs::read_to_string(dir.join("ha.env")).unwrap();
        let var = |name: &str| env.lines().find_map(|l| l.strip_prefix(&format!("{name}="))).unwrap().to_owned();
        let token = std::fs::read_to_string(Path::new(&var("HA_DATA_DIR")).join("admin.token")).unwrap().trim().to_owned();
        (cluster, var("HA_API_URL"), token)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(root().join("scripts/ha-down")).env("HA_DIR", &self.dir).status();
    }
}

/// One PostgreSQL server (`initdb`, its defaults) and one `serve` on it; both stopped when
/// dropped.
struct Plain {
    pg_ctl: PathBuf,
    data: PathBuf,
    serve: Child,
}

impl Plain {
    fn up(dir: &Path) -> (Plain, String, String) {
        let pg_bin = std::fs::read_dir("/usr/lib/postgresql")
            .expect("PostgreSQL's server binaries under /usr/lib/postgresql")
            .flatten()
            .map(|e| e.path().join("bin"))
            .filter(|p| p.join("postgres").exists())
            .max()
            .expect("a PostgreSQL version under /usr/lib/postgresql");
        let pg_dir = dir.join("pg");
        std::fs::create_dir_all(&pg_dir).unwrap();
        if is_root() {
            Command::new("chown").arg("postgres").arg(&pg_dir).status().unwrap();
        }
        let data = pg_dir.join("data");
        let initdb = as_postgres(&pg_bin.join("initdb"))
            .args(["-D"])
            .arg(&data)
            .args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "--locale=C.UTF-8"])
            .output()
            .unwrap();
        assert!(initdb.status.success(), "initdb: {}", String::from_utf8_lossy(&initdb.stderr));
        let port = BASE + 60;
        let options = format!(
            "-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={} -c max_connections=200",
            pg_dir.display()
        );
        let started = as_postgres(&pg_bin.join("pg_ctl"))
            .args(["-D"])
            .arg(&data)
            .args(["-o", &options, "-l"])
            .arg(pg_dir.join("postgres.log"))
            .args(["-w", "start"])
            .output()
            .unwrap();
        assert!(started.status.success(), "pg_ctl start: {}", String::from_utf8_lossy(&started.stderr));
        let plain_pg = |serve| Plain { pg_ctl: pg_bin.join("pg_ctl"), data: data.clone(), serve };
        let created = Command::new("psql")
            .args([&format!("host=127.0.0.1 port={port} user=postgres dbname=postgres"), "-qc", "CREATE DATABASE bc"])
            .output()
            .unwrap();
        let database_url = format!("postgres://postgres@127.0.0.1:{port}/bc?sslmode=disable");
        let migrate = Command::new(binary()).args(["migrate", "--database-url", &database_url]).output().unwrap();
        let (api, agents) = (BASE + 61, BASE + 62);
        let log = std::fs::File::create(dir.join("serve.log")).unwrap();
        let serve = Command::new(binary())
            .args(["serve", "--database-url", &database_url, "--data-dir"])
            .arg(dir.join("serve"))
            .args(["--listen", &format!("127.0.0.1:{api}"), "--agents-listen", &format!("127.0.0.1:{agents}")])
            .args(["--rate-per-key", "0", "--rate-per-tenant", "0"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        // Owned before the checks, so a failure stops what started.
        let plain = plain_pg(serve);
        assert!(created.status.success(), "CREATE DATABASE: {}", String::from_utf8_lossy(&created.stderr));
        assert!(migrate.status.success(), "migrate: {}", String::from_utf8_lossy(&migrate.stderr));
        let token_path = dir.join("serve/admin.token");
        wait_for("the plain gateway ready", Duration::from_secs(60), || {
            std::net::TcpStream::connect(("127.0.0.1", api)).is_ok() && token_path.exists()
        });
        let token = std::fs::read_to_string(&token_path).unwrap().trim().to_owned();
        (plain, format!("http://127.0.0.1:{api}"), token)
    }
}

impl Drop for Plain {
    fn drop(&mut self) {
        let _ = self.serve.kill();
        let _ = self.serve.wait();
        let _ = as_postgres(&self.pg_ctl).args(["-D"]).arg(&self.data).args(["-m", "fast", "stop"]).output();
    }
}

fn cell(url: &str, token: &str, dir: &Path) -> Cell {
    let mut lua = String::new();
    lua.push_str("wrk.headers[\"Content-Type\"] = \"application/json\"\n");
    lua.push_str(&format!("wrk.headers[\"Authorization\"] = \"Bearer {token}\"\n"));
    lua.push_str(wrk::THREAD_IDS_LUA);
    lua.push_str(LUA);
    wrk::run(url, &lua, WRK_THREADS, CONNECTIONS, WRK_DURATION_S, dir)
}

pub fn main() {
    // The postgres user must reach the members' directories: a directory of its own in /tmp.
    let temp = tempfile::Builder::new().prefix("bc-bench-ha-").tempdir_in("/tmp").unwrap();
    std::fs::set_permissions(temp.path(), std::os::unix::fs::PermissionsExt::from_mode(0o711)).unwrap();
    eprintln!(
        "ha_writes: two gateways on a Patroni cluster (HAProxy) against one gateway on one PostgreSQL, wrk {WRK_DURATION_S} s a cell"
    );
    let (_cluster, cluster_url, cluster_token) = Cluster::up(&temp.path().join("ha"));
    let plain_dir = temp.path().join("plain");
    std::fs::create_dir_all(&plain_dir).unwrap();
    std::fs::set_permissions(&plain_dir, std::os::unix::fs::PermissionsExt::from_mode(0o711)).unwrap();
    let (_plain, plain_url, plain_token) = Plain::up(&plain_dir);
    let scripts = temp.path().join("wrk");
    std::fs::create_dir_all(&scripts).unwrap();
    let mut rows = Vec::new();
    for round in 1..=ROUNDS {
        // The order swapped each round, so neither side always runs on a warmer machine.
        let cluster_first = round % 2 == 1;
        let measure = |name: &str, url: &str, token: &str| {
            eprintln!("  round {round}: {name}…");
            cell(url, token, &scripts)
        };
        let (ha, plain) = if cluster_first {
            let ha = measure("two gateways on the cluster", &cluster_url, &cluster_token);
            (ha, measure("one gateway on one PostgreSQL", &plain_url, &plain_token))
        } else {
            let plain = measure("one gateway on one PostgreSQL", &plain_url, &plain_token);
            (measure("two gateways on the cluster", &cluster_url, &cluster_token), plain)
        };
        rows.push((round, ha, plain));
    }
    println!();
    println!(
        "| round | cluster, 2 gateways writes/s | p50 / p99 ms | 1 PostgreSQL, 1 gateway writes/s | p50 / p99 ms | cluster ÷ plain |"
    );
    println!(
        "|------:|-----------------------------:|-------------:|---------------------------------:|-------------:|----------------:|"
    );
    for (round, ha, plain) in &rows {
        println!(
            "| {round:>5} | {:>28.0} | {:>5.1} / {:<5.1} | {:>32.0} | {:>5.1} / {:<5.1} | {:>15.2} |",
            ha.requests_per_s,
            ha.p50_ms,
            ha.p99_ms,
            plain.requests_per_s,
            plain.p50_ms,
            plain.p99_ms,
            ha.requests_per_s / plain.requests_per_s
        );
    }
    let mut ratios: Vec<f64> = rows.iter().map(|(_, ha, plain)| ha.requests_per_s / plain.requests_per_s).collect();
    ratios.sort_by(f64::total_cmp);
    let each: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
    println!(
        "high availability: writes through two gateways on the cluster ÷ one gateway on one PostgreSQL, {CONNECTIONS} connections: {:.2} (median; rounds: {}); no goal set",
        ratios[ratios.len() / 2],
        each.join(", ")
    );
}
