//! High availability (issue 60), from outside, on the recipe's own cluster (`scripts/ha-up`):
//! etcd, three PostgreSQL members under Patroni (synchronous replication, strict), two `serve`
//! processes on the members' multi-host URL, HAProxy in front. 16 writers create pools through
//! HAProxy, each with its own idempotency key, while the primary's PostgreSQL and its Patroni are
//! killed with SIGKILL, three times, a different member each time (the killed member is restarted
//! and rejoins as a standby between kills). Then: every acknowledged write is in the log, each
//! key's pool exists once (every indeterminate or unanswered write was retried with its key until
//! answered), `audit verify` passes, no write was refused as anything but `UNAVAILABLE`, and the
//! longest stretch without an acknowledged write around each kill is within Patroni's TTL plus
//! 10 s. The negative control runs the same with `synchronous_commit = local`, the primary's WAL
//! senders stopped a second before the kill (its standbys fallen behind: without it, on loopback,
//! three runs lost 21, 8 and 0 acknowledged writes) and Patroni's lag bound lifted (at its 1 MiB a
//! standby a second behind was sometimes not promoted at all), one kill, and must lose an
//! acknowledged write in the same check.
//!
//! All three are in `make test` (each cluster on ports of its own: 25400, 25600, 25800; about
//! 100, 50 and 60 s of wall time, most of it waiting out Patroni's TTL, started first so they
//! overlap the rest of the suite); `make test-ha` runs them alone, one at a time. The third,
//! `reconcilers_in_two_gateways_do_each_piece_of_work_once_across_a_failover`, kills one primary
//! under 4 writers and the reconcilers' work. Patroni's timings come from `BC_HA_TTL`, `BC_HA_LOOP_WAIT`
//! and `BC_HA_RETRY_TIMEOUT` (default 10, 2 and 4 s: tuned; Patroni's defaults are 30, 10, 10).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bc_tests::wait_until;
use serde_json::{Value, json};

const WRITERS: usize = 16;
/// Writers in the one-kill test `make test` runs beside the rest of the suite.
const FAILOVER_WRITERS: usize = 4;
const KILLS: usize = 3;
/// Kills in the negative control: one primary lost with its standbys a second behind loses
/// acknowledged writes; a second round only added time (and, at Patroni's lag bound, could find
/// no standby it would promote: 70 s without a primary in one run).
const CONTROL_KILLS: usize = 1;
/// Patroni's `maximum_lag_on_failover` (its default): a standby further behind is not promoted.
const PATRONI_MAXIMUM_LAG_BYTES: u64 = 1 << 20;
/// The negative control's: any standby is promoted, however far behind, as an asynchronous
/// cluster that does not guard against lag would.
const CONTROL_MAXIMUM_LAG_BYTES: u64 = 1 << 40;
/// The simulated machines (`bcd sim`) of the one-kill test: the liveness reconciler's work.
const AGENTS: usize = 4;
/// How long one write may be retried with its key before the writer gives up on it (reported
/// as unresolved, and checked to be in the log at most once).
const RETRY_FOR: Duration = Duration::from_secs(120);

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The cluster `scripts/ha-up` brought up in a directory of its own; `scripts/ha-down` when
/// dropped (the directory kept, with its logs, when the test failed).
struct Cluster {
    dir: PathBuf,
    base: u16,
    ttl: u64,
    env: HashMap<String, String>,
    temp: Option<tempfile::TempDir>,
    /// `better-compute`, as `serve` runs it.
    binary: PathBuf,
    /// The members this test started again: stopped by ha-down, waited for when dropped.
    restarted: Mutex<Vec<std::process::Child>>,
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn as_postgres(program: &str) -> Command {
    // ha-up runs the members as the postgres user when it runs as root: so do restarts.
    let root_user = Command::new("id").arg("-u").output().map(|o| o.stdout == b"0\n").unwrap_or(false);
    if root_user {
        // setpriv execs, so the child's pid is the program's (runuser forks and waits).
        let mut command = Command::new("setpriv");
        command.args(["--reuid=postgres", "--regid=postgres", "--init-groups", program]);
        command
    } else {
        Command::new(program)
    }
}

impl Cluster {
    /// `max_lag`: the bytes a standby may lag and still be promoted (Patroni's
    /// `maximum_lag_on_failover`, `HA_MAXIMUM_LAG_ON_FAILOVER`).
    fn up(synchronous_commit: &str, base: u16, max_lag: u64) -> Cluster {
        Cluster::up_with(synchronous_commit, base, "", max_lag)
    }

    /// `serve_args`: more flags for both gateways (`HA_SERVE_ARGS`).
    fn up_with(synchronous_commit: &str, base: u16, serve_args: &str, max_lag: u64) -> Cluster {
        let temp = tempfile::Builder::new().prefix("bc-ha-").tempdir_in("/tmp").expect("tempdir");
        let dir = temp.path().join("ha");
        let ttl = env_u64("BC_HA_TTL", 10);
        let binary = bc_tests::binary("better-compute");
        let output = Command::new(root().join("scripts/ha-up"))
            .env("HA_DIR", &dir)
            .env("HA_PORT_BASE", base.to_string())
            .env("HA_TTL", ttl.to_string())
            .env("HA_LOOP_WAIT", env_u64("BC_HA_LOOP_WAIT", 2).to_string())
            .env("HA_RETRY_TIMEOUT", env_u64("BC_HA_RETRY_TIMEOUT", 4).to_string())
            .env("HA_SYNCHRONOUS_COMMIT", synchronous_commit)
            .env("HA_MAXIMUM_LAG_ON_FAILOVER", max_lag.to_string())
            .env("BETTER_COMPUTE_BIN", &binary)
            .env("HA_SERVE_ARGS", serve_args)
            .output()
            .expect("scripts/ha-up");
        let mut cluster = Cluster {
            dir: dir.clone(),
            base,
            ttl,
            env: HashMap::new(),
            temp: Some(temp),
            binary: binary.clone(),
            restarted: Mutex::new(Vec::new()),
        };
        assert!(output.status.success(), "ha-up failed: {}", String::from_utf8_lossy(&output.stderr));
        let text = std::fs::read_to_string(dir.join("ha.env")).unwrap();
        cluster.env = text.lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect();
        cluster
    }

    fn var(&self, name: &str) -> &str {
        &self.env[name]
    }

    fn config(&self, member: usize) -> PathBuf {
        self.dir.join(format!("run/patroni-{member}.yml"))
    }

    /// The member Patroni says is the primary, if one is.
    fn leader(&self) -> Option<usize> {
        (1..=3).find(|n| {
            Command::new("curl")
                .args(["-sf", "-o", "/dev/null", "--max-time", "2"])
                .arg(format!("http://127.0.0.1:{}/primary", self.base + 20 + *n as u16))
                .status()
                .is_ok_and(|s| s.success())
        })
    }

    /// The primary has a synchronous standby and both standbys stream.
    fn healthy(&self) -> bool {
        let conninfo = format!(
            "host=127.0.0.1,127.0.0.1,127.0.0.1 port={},{},{} user=postgres dbname=postgres target_session_attrs=read-write connect_timeout=2",
            self.base + 11,
            self.base + 12,
            self.base + 13
        );
        let out = Command::new("psql")
            .args([
                &conninfo,
                "-Atc",
                "SELECT count(*) FILTER (WHERE sync_state = 'sync'), count(*) FILTER (WHERE state = 'streaming') FROM pg_stat_replication",
            ])
            .output();
        out.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "1|2")
    }

    /// SIGKILL to the member's Patroni, its postmaster and every process the postmaster started:
    /// the machine gone at once.
    fn kill(&self, member: usize) {
        let mut pids = Vec::new();
        let pids_file = std::fs::read_to_string(self.dir.join("pids")).unwrap();
        let name = format!("patroni-{member}");
        if let Some(pid) =
            pids_file.lines().filter_map(|l| l.split_once(' ')).filter(|(n, _)| *n == name).map(|(_, p)| p).next_back()
        {
            pids.push(pid.trim().to_owned());
        }
        let pidfile = self.dir.join(format!("run/member-{member}/data/postmaster.pid"));
        if let Some(postmaster) = std::fs::read_to_string(&pidfile).ok().and_then(|t| t.lines().next().map(str::to_owned)) {
            pids.extend(children(&postmaster));
            pids.push(postmaster);
        }
        assert!(pids.len() >= 2, "member-{member}'s Patroni and PostgreSQL: {pids:?}");
        // A backend may have ended between the listing and the kill: its pid is no error.
        Command::new("kill").arg("-KILL").args(&pids).stderr(std::process::Stdio::null()).status().unwrap();
        // Gone, or a zombie (a restarted member is this process's child, never waited for).
        let alive = |pid: &String| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|stat| stat.rsplit_once(')').is_some_and(|(_, rest)| rest.split_whitespace().next() != Some("Z")))
        };
        wait_until("the member's processes gone", Duration::from_secs(10), || {
            (!alive(&pids[pids.len() - 1]) && !alive(&pids[0])).then_some(())
        });
    }

    /// Stops (`SIGSTOP`) the primary's WAL senders (children of its postmaster): its standbys
    /// fall behind, as over a slow network. With `synchronous_commit = on` commits wait
    /// meanwhile; with `local` they are acknowledged on the primary alone. (Stopping the
    /// standbys' receivers instead loses nothing on loopback: the socket buffers hold the WAL.)
    fn stop_wal_senders(&self, primary: usize) {
        let pidfile = self.dir.join(format!("run/member-{primary}/data/postmaster.pid"));
        let postmaster = std::fs::read_to_string(&pidfile).unwrap().lines().next().unwrap().to_owned();
        let senders: Vec<String> = children(&postmaster)
            .into_iter()
            .filter(|child| {
                String::from_utf8_lossy(&std::fs::read(format!("/proc/{child}/cmdline")).unwrap_or_default())
                    .contains("walsender")
            })
            .collect();
        assert!(!senders.is_empty(), "member-{primary} streams to its standbys");
        Command::new("kill").arg("-STOP").args(&senders).stderr(std::process::Stdio::null()).status().unwrap();
    }

    /// Starts the member's Patroni again (it rejoins as a standby, rewound if it must be).
    fn restart(&self, member: usize) {
        let log = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(self.dir.join(format!("log/patroni-{member}.log")))
            .unwrap();
        let child = as_postgres("patroni")
            .arg(self.config(member))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("patroni");
        let mut pids = std::fs::OpenOptions::new().append(true).open(self.dir.join("pids")).unwrap();
        std::io::Write::write_all(&mut pids, format!("patroni-{member} {}\n", child.id()).as_bytes()).unwrap();
        self.restarted.lock().unwrap().push(child);
    }

    fn switchover(&self, from: usize, to: usize) {
        let output = Command::new("patronictl")
            .arg("-c")
            .arg(self.config(1))
            .args(["switchover", "--leader", &format!("member-{from}"), "--candidate", &format!("member-{to}"), "--force"])
            .output()
            .unwrap();
        assert!(output.status.success(), "switchover: {}", String::from_utf8_lossy(&output.stderr));
    }
}

/// `bcd sim`'s machines, joined through HAProxy's agents' port: one process, stopped and
/// continued as a whole. Killed when dropped (continued first, if stopped).
struct SimAgents {
    child: std::process::Child,
}

impl SimAgents {
    /// `STOP` freezes every machine at once (their connections stay open, nothing answers);
    /// `CONT` lets them run on.
    fn signal(&self, signal: &str) {
        Command::new("kill").arg(format!("-{signal}")).arg(self.child.id().to_string()).status().unwrap();
    }
}

impl Drop for SimAgents {
    fn drop(&mut self) {
        self.signal("CONT");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Cluster {
    /// `count` simulated machines (`bcd sim`) joining with `token` through HAProxy's agents'
    /// port, pinning the gateways' shared serving key (from `serve`'s banner) and log key
    /// (`pki show`), as a real machine's `config.toml` does. Their log: `log/bcd-sim.log`.
    fn agents(&self, token: &str, count: usize) -> SimAgents {
        let banner = std::fs::read_to_string(self.dir.join("log/serve-1.log")).unwrap();
        let pin = banner
            .lines()
            .find_map(|l| l.trim_start().strip_prefix("agents:"))
            .and_then(|rest| rest.split_once("(pin "))
            .map(|(_, pin)| pin.trim().trim_end_matches(')').to_owned())
            .unwrap_or_else(|| panic!("serve's banner names the agents' pin:\n{banner}"));
        let (code, out, err) = bc_tests::cli(&["pki", "show", "--data-dir", self.var("HA_DATA_DIR")], &[]);
        assert_eq!(code, 0, "pki show: {err}");
        let log_pin = bc_tests::json(&out)["pin"].as_str().unwrap().to_owned();
        let config = self.dir.join("run/bcd-sim.toml");
        let gateway = self.var("HA_AGENTS_ADDR");
        std::fs::write(
            &config,
            format!(
                "data_dir = \"/unused\"\ngateway = \"https://{gateway}\"\nserving_ca_spki_pin = {pin:?}\nlog_key_pin = {log_pin:?}\n"
            ),
        )
        .unwrap();
        let log = std::fs::File::create(self.dir.join("log/bcd-sim.log")).unwrap();
        let child = Command::new(bc_tests::binary("bcd"))
            .args(["sim", "--nodes", &count.to_string(), "--data-dir"])
            .arg(self.dir.join("machines"))
            .arg("--config")
            .arg(&config)
            .env("BCD_JOIN_TOKEN", token)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("bcd sim");
        SimAgents { child }
    }
}

/// The pids whose parent is `parent` (/proc/PID/stat's fourth field).
fn children(parent: &str) -> Vec<String> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        if let Ok(stat) = std::fs::read_to_string(entry.path().join("stat"))
            && let Some((_, rest)) = stat.rsplit_once(')')
            && rest.split_whitespace().nth(1) == Some(parent)
        {
            out.push(name);
        }
    }
    out
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(root().join("scripts/ha-down")).env("HA_DIR", &self.dir).status();
        for mut child in self.restarted.lock().map(|mut c| std::mem::take(&mut *c)).unwrap_or_default() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking()
            && let Some(temp) = self.temp.take()
        {
            eprintln!("the cluster's directory is kept: {}", temp.keep().display());
        }
    }
}

/// What the writers saw.
#[derive(Default)]
struct Seen {
    /// (key, poolId, when) of every write answered 200.
    acked: Vec<(String, String, Instant)>,
    /// Keys given up on after [`RETRY_FOR`] without an answer.
    unresolved: Vec<String>,
    /// Answers other than 200 and 503 UNAVAILABLE: a failure reported as plain.
    refused: Vec<String>,
}

#[derive(Default)]
struct Counts {
    indeterminate: AtomicU64,
    unavailable: AtomicU64,
    transport: AtomicU64,
}

async fn writer(w: usize, url: String, token: String, stop: Arc<AtomicBool>, seen: Arc<Mutex<Seen>>, counts: Arc<Counts>) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap();
    let mut i = 0;
    while !stop.load(Ordering::Relaxed) {
        let key = format!("w{w}-{i}");
        i += 1;
        let started = Instant::now();
        loop {
            let sent = http
                .post(format!("{url}/api/compute/pools.create"))
                .bearer_auth(&token)
                .header("idempotency-key", &key)
                .json(&json!({ "name": key }))
                .send()
                .await;
            match sent {
                Ok(response) => {
                    let status = response.status().as_u16();
                    let body: Value = response.json().await.unwrap_or(Value::Null);
                    match status {
                        200 => {
                            let pool = body["poolId"].as_str().unwrap_or_default().to_owned();
                            seen.lock().unwrap().acked.push((key.clone(), pool, Instant::now()));
                            break;
                        }
                        503 if body["code"] == "UNAVAILABLE" => {
                            let indeterminate = body["details"]["indeterminate"] == true;
                            if indeterminate {
                                assert!(
                                    body["details"]["hint"].as_str().is_some_and(|h| h.contains("Idempotency-Key")),
                                    "{body}"
                                );
                            }
                            let counter = if indeterminate { &counts.indeterminate } else { &counts.unavailable };
                            counter.fetch_add(1, Ordering::Relaxed);
                        }
                        // HAProxy's own answer while no gateway is up: nothing reached a gateway.
                        503 if body.is_null() => {
                            counts.transport.fetch_add(1, Ordering::Relaxed);
                        }
                        _ => {
                            seen.lock().unwrap().refused.push(format!("{key}: {status} {body}"));
                            break;
                        }
                    }
                }
                // The connection lost (a gateway or the proxy): as unknown as an indeterminate
                // answer, and retried the same way, with the key.
                Err(_) => {
                    counts.transport.fetch_add(1, Ordering::Relaxed);
                }
            }
            if started.elapsed() > RETRY_FOR {
                seen.lock().unwrap().unresolved.push(key.clone());
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// The longest stretch without an acknowledgement around each kill: from the last one before
/// the kill (in a lagging run the WAL senders stop a second before it, and commits wait or not)
/// to TTL + 60 s after it, in seconds.
fn write_gaps(seen: &Seen, kills: &[Instant], ttl: u64) -> Vec<f64> {
    let mut times: Vec<Instant> = seen.acked.iter().map(|(_, _, t)| *t).collect();
    times.sort();
    kills
        .iter()
        .map(|at| {
            let last_before = times.iter().copied().rfind(|t| t <= at);
            let window: Vec<Instant> = last_before
                .into_iter()
                .chain(times.iter().copied().filter(|t| t > at && *t <= *at + Duration::from_secs(ttl + 60)))
                .collect();
            window.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()).fold(0.0, f64::max)
        })
        .collect()
}

/// From what the database holds (every pool by name; a name is its write's key): the keys of
/// acknowledged writes whose pool is not there, and the keys whose pool is there more than once.
async fn lost_and_twice(client: &tokio_postgres::Client, seen: &Seen) -> (Vec<String>, Vec<String>) {
    let rows = client.query("SELECT doc::jsonb->>'name', id FROM projections WHERE kind = 'pool'", &[]).await.unwrap();
    let mut stored: HashMap<String, Vec<String>> = HashMap::new();
    for row in rows {
        stored.entry(row.get(0)).or_default().push(row.get(1));
    }
    let lost = seen
        .acked
        .iter()
        .filter(|(key, pool, _)| !stored.get(key).is_some_and(|ids| ids.contains(pool)))
        .map(|(key, _, _)| key.clone())
        .collect();
    let twice = stored.iter().filter(|(_, ids)| ids.len() > 1).map(|(k, _)| k.clone()).collect();
    (lost, twice)
}

/// What a run found, checked by the caller.
struct Outcome {
    acked: usize,
    /// Acknowledged writes whose pool is not in the database afterwards.
    lost: Vec<String>,
    /// Keys whose pool exists more than once.
    twice: Vec<String>,
    refused: Vec<String>,
    unresolved: usize,
    audit_ok: bool,
    audit_out: String,
    /// The longest stretch without an acknowledged write around each kill, in seconds.
    gaps: Vec<f64>,
    answered_unavailable: u64,
    indeterminate: u64,
    ttl: u64,
}

/// `lag` (the negative control): the primary's WAL senders are stopped a second before the kill
/// (standbys fallen behind), so an asynchronous cluster has acknowledged what no standby has, and
/// a standby is promoted however far behind; one kill ([`CONTROL_KILLS`]), not [`KILLS`].
async fn run(synchronous_commit: &str, base: u16, lag: bool) -> Outcome {
    let (rounds, max_lag) = if lag { (CONTROL_KILLS, CONTROL_MAXIMUM_LAG_BYTES) } else { (KILLS, PATRONI_MAXIMUM_LAG_BYTES) };
    let cluster = Cluster::up(synchronous_commit, base, max_lag);
    let url = cluster.var("HA_API_URL").to_owned();
    let token = std::fs::read_to_string(Path::new(cluster.var("HA_DATA_DIR")).join("admin.token")).unwrap().trim().to_owned();
    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let counts = Arc::new(Counts::default());
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| tokio::spawn(writer(w, url.clone(), token.clone(), stop.clone(), seen.clone(), counts.clone())))
        .collect();
    let acked = || seen.lock().unwrap().acked.len();

    let mut killed = HashSet::new();
    let mut kills = Vec::new();
    for round in 0..rounds {
        // Load first: writes acknowledged on this primary.
        let before = acked();
        wait_until("writes under load", Duration::from_secs(60), || (acked() >= before + 200).then_some(()));
        let mut leader = wait_until("a primary", Duration::from_secs(60), || cluster.leader());
        if killed.contains(&leader) {
            // A member not killed yet takes over first, so each kill is of another member.
            let to = (1..=3).find(|m| !killed.contains(m) && *m != leader).unwrap();
            cluster.switchover(leader, to);
            wait_until("the switchover", Duration::from_secs(60), || {
                (cluster.leader() == Some(to) && cluster.healthy()).then_some(())
            });
            leader = to;
            let before = acked();
            wait_until("writes after the switchover", Duration::from_secs(60), || (acked() >= before + 100).then_some(()));
        }
        // The standbys fall a second behind, then the primary dies: what a synchronous commit
        // acknowledged is on a standby all the same; what an asynchronous one did may not be.
        if lag {
            cluster.stop_wal_senders(leader);
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let at = Instant::now();
        cluster.kill(leader);
        killed.insert(leader);
        eprintln!("round {round}: killed member-{leader} (primary) with {} writes acknowledged", acked());
        let new_leader =
            wait_until("a new primary", Duration::from_secs(cluster.ttl + 60), || cluster.leader().filter(|l| *l != leader));
        wait_until("writes after the kill", Duration::from_secs(cluster.ttl + 60), || {
            let after = seen.lock().unwrap().acked.iter().filter(|(_, _, t)| *t > at + Duration::from_millis(500)).count();
            (after >= 50).then_some(())
        });
        kills.push(at);
        eprintln!("round {round}: member-{new_leader} is the primary; writes resumed");
        cluster.restart(leader);
        wait_until("the killed member back as a standby", Duration::from_secs(180), || cluster.healthy().then_some(()));
    }
    let before = acked();
    wait_until("writes after the last kill", Duration::from_secs(60), || (acked() >= before + 100).then_some(()));
    stop.store(true, Ordering::Relaxed);
    for writer in writers {
        writer.await.unwrap();
    }

    let seen = std::mem::take(&mut *seen.lock().unwrap());
    let gaps = write_gaps(&seen, &kills, cluster.ttl);
    let (client, connection) = tokio_postgres::connect(cluster.var("HA_DATABASE_URL"), tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    let (lost, twice) = lost_and_twice(&client, &seen).await;
    // The binary the gateways run (checked fresh when the cluster came up).
    let verify = Command::new(&cluster.binary)
        .args(["audit", "verify", "--database-url", cluster.var("HA_DATABASE_URL"), "--data-dir", cluster.var("HA_DATA_DIR")])
        .output()
        .unwrap();
    let (code, out, err) =
        (verify.status.code().unwrap_or(-1), String::from_utf8_lossy(&verify.stdout), String::from_utf8_lossy(&verify.stderr));
    Outcome {
        acked: seen.acked.len(),
        lost,
        twice,
        refused: seen.refused,
        unresolved: seen.unresolved.len(),
        audit_ok: code == 0,
        audit_out: format!("{out} {err}"),
        gaps,
        answered_unavailable: counts.unavailable.load(Ordering::Relaxed)
            + counts.indeterminate.load(Ordering::Relaxed)
            + counts.transport.load(Ordering::Relaxed),
        indeterminate: counts.indeterminate.load(Ordering::Relaxed),
        ttl: cluster.ttl,
    }
}

fn report(name: &str, o: &Outcome) {
    let mut gaps = o.gaps.clone();
    gaps.sort_by(f64::total_cmp);
    eprintln!(
        "{name}: ttl {} s; {} writes acknowledged, {} lost, {} twice, {} refused, {} unresolved; {} answers UNAVAILABLE \
         or no answer ({} indeterminate); write gaps {:?} s (p50 {:.1}, max {:.1}); audit verify {}",
        o.ttl,
        o.acked,
        o.lost.len(),
        o.twice.len(),
        o.refused.len(),
        o.unresolved,
        o.answered_unavailable,
        o.indeterminate,
        o.gaps.iter().map(|g| (g * 10.0).round() / 10.0).collect::<Vec<_>>(),
        gaps[gaps.len() / 2],
        gaps.last().copied().unwrap_or(0.0),
        if o.audit_ok { "passed" } else { "FAILED" }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn acknowledged_writes_survive_three_primary_kills() {
    let o = run("on", 25400, false).await;
    report("synchronous_commit = on", &o);
    assert!(o.lost.is_empty(), "acknowledged writes lost: {:?}", &o.lost[..o.lost.len().min(20)]);
    assert!(o.twice.is_empty(), "writes made twice: {:?}", o.twice);
    assert!(o.refused.is_empty(), "failures reported as plain: {:?}", &o.refused[..o.refused.len().min(20)]);
    assert_eq!(o.unresolved, 0, "every write retried with its key was answered");
    assert!(o.audit_ok, "audit verify: {}", o.audit_out);
    for gap in &o.gaps {
        assert!(*gap <= (o.ttl + 10) as f64, "writes resumed {gap:.1} s after the kill, past the TTL + 10 s");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn asynchronous_commit_loses_acknowledged_writes_in_the_same_check() {
    let o = run("local", 25600, true).await;
    report("synchronous_commit = local (negative control)", &o);
    assert!(o.audit_ok, "the log that is left still verifies: {}", o.audit_out);
    assert!(
        !o.lost.is_empty(),
        "the negative control lost no acknowledged write over {CONTROL_KILLS} kill: the check did not show it can fail this run"
    );
}

/// Sends `method` with `body` under the idempotency key `key` until it is answered: 503
/// `UNAVAILABLE` (indeterminate or not), HAProxy's own 503 and a lost connection are sent again
/// with the same key every 200 ms, as the writers do, for at most [`RETRY_FOR`]. `Err` names any
/// other answer, or the key given up on.
async fn call_until_answered(
    http: &reqwest::Client,
    url: &str,
    token: &str,
    method: &str,
    key: &str,
    body: &Value,
) -> Result<Value, String> {
    let started = Instant::now();
    loop {
        let sent = http
            .post(format!("{url}/api/compute/{method}"))
            .bearer_auth(token)
            .header("idempotency-key", key)
            .json(body)
            .send()
            .await;
        if let Ok(response) = sent {
            let status = response.status().as_u16();
            let answer: Value = response.json().await.unwrap_or(Value::Null);
            match status {
                200 => return Ok(answer),
                503 if answer["code"] == "UNAVAILABLE" || answer.is_null() => {}
                _ => return Err(format!("{method} {key}: {status} {answer}")),
            }
        }
        if started.elapsed() > RETRY_FOR {
            return Err(format!("{method} {key}: unanswered for {RETRY_FOR:?}"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What the two work makers made: each id once it was answered.
#[derive(Default)]
struct Made {
    reservations: Vec<String>,
    /// Pings to the frozen machines: the liveness reconciler fails each at its deadline.
    commands: Vec<String>,
    /// Pings the machines answered, before the freeze and after they ran on.
    answered: Vec<String>,
    refused: Vec<String>,
}

/// The reconcilers in two processes across a failover (issue 60), the one-kill test `make test`
/// runs: both gateways run every reconciler on the recipe's cluster (tuned TTLs). Work the
/// reconcilers must do is made through HAProxy throughout: reservations of 1 GPU for 2 s in a
/// pool of 8 hand-registered GPUs (the `reservations` reconciler activates queued ones and
/// expires active ones), and a webhook subscribed to them, delivered to a receiver on loopback
/// that holds each request 300 ms (so deliveries are in flight when the primary dies); beside
/// them 4 writers as the three-kill test has. The primary is killed with SIGKILL once, mid-run.
/// Then, from the log and the receiver: every acknowledged write in the log once, writes back
/// within the TTL plus 10 s; every reservation activated once and expired once, no such event
/// twice on any stream; every delivery done, every event delivered, and no receipt beyond the
/// attempts recorded for it (at least once, and each attempt recorded: an attempt whose record
/// failed while there was no primary is recorded once there is one, not sent again
/// unrecorded). The `liveness` reconciler's work: four machines of `bcd sim` join through
/// HAProxy's agents' port and answer pings; just before the kill they are frozen (SIGSTOP) with
/// two pings each queued whose 2 s deadlines pass while there is no primary; after the failover
/// every such ping fails once, every machine goes `unreachable` once its lease lapses, and,
/// continued, `ready` again and answers: in the log no ping both failed and succeeded, none
/// ended twice, and no machine has the same reachability change twice in a row (a second
/// reconciler redoing the first's work). `audit verify` passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reconcilers_in_two_gateways_do_each_piece_of_work_once_across_a_failover() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cluster = Cluster::up_with("on", 25800, "--webhook-allow-loopback", PATRONI_MAXIMUM_LAG_BYTES);
    let url = cluster.var("HA_API_URL").to_owned();
    let token = std::fs::read_to_string(Path::new(cluster.var("HA_DATA_DIR")).join("admin.token")).unwrap().trim().to_owned();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap();
    let receiver = bc_tests::receiver::Receiver::start();
    receiver.delay(300);

    let call = {
        let (http, url, token) = (http.clone(), url.clone(), token.clone());
        move |method: &'static str, key: String, body: Value| {
            let (http, url, token) = (http.clone(), url.clone(), token.clone());
            async move { call_until_answered(&http, &url, &token, method, &key, &body).await }
        }
    };
    let pool = call("pools.create", "setup-pool".into(), json!({ "name": "work" })).await.unwrap()["poolId"]
        .as_str()
        .unwrap()
        .to_owned();
    let gpus = vec![json!({ "model": "H100", "product": "H100-SXM5-80GB", "vramGiB": 80, "nvlinkDomain": 0 }); 4];
    let mut nodes = Vec::new();
    for n in 0..2 {
        let node =
            call("nodes.register", format!("setup-node-{n}"), json!({ "poolId": pool, "name": format!("n{n}"), "gpus": gpus }))
                .await
                .unwrap();
        nodes.push(node["nodeId"].as_str().unwrap().to_owned());
    }
    let webhook = call(
        "webhooks.create",
        "setup-webhook".into(),
        json!({ "url": receiver.url, "eventTypes": ["reservation.*", "command.*"] }),
    )
    .await
    .unwrap();
    let webhook = webhook["webhookId"].as_str().unwrap().to_owned();

    // The liveness reconciler's work needs machines with sessions: `bcd sim`'s, in a pool of
    // their own, joined through HAProxy to whichever gateway it picks.
    let agent_pool = call("pools.create", "setup-agent-pool".into(), json!({ "name": "agents" })).await.unwrap()["poolId"]
        .as_str()
        .unwrap()
        .to_owned();
    let join =
        call("joinTokens.create", "setup-join-token".into(), json!({ "poolId": agent_pool, "uses": AGENTS })).await.unwrap();
    let agents = cluster.agents(join["token"].as_str().unwrap(), AGENTS);
    let reads = AtomicU64::new(0);
    let read = |method: &'static str, body: Value| {
        let key = format!("read-{}", reads.fetch_add(1, Ordering::Relaxed));
        bc_tests::block_on(call(method, key, body)).unwrap()
    };
    let nodes_in = |state: &str| {
        let page = read("nodes.list", json!({ "poolId": agent_pool, "limit": 100 }));
        let nodes = page["items"].as_array().unwrap();
        (nodes.len() == AGENTS && nodes.iter().all(|n| n["state"] == state))
            .then(|| nodes.iter().map(|n| n["nodeId"].as_str().unwrap().to_owned()).collect::<Vec<_>>())
    };
    let commands_in = |ids: &[String], state: &str| {
        ids.iter().all(|id| read("commands.get", json!({ "commandId": id }))["state"] == state).then_some(())
    };
    let agent_nodes = wait_until("the simulated machines ready", Duration::from_secs(90), || nodes_in("ready"));
    let ping = |key: String, node: &str, deadline_s: u64| {
        let body = json!({ "nodeId": node, "kind": "ping", "deadlineS": deadline_s });
        bc_tests::block_on(call("commands.issue", key, body)).unwrap()["commandId"].as_str().unwrap().to_owned()
    };

    let stop = Arc::new(AtomicBool::new(false));
    let made = Arc::new(Mutex::new(Made::default()));
    let reserver = {
        let (stop, made, call, pool) = (stop.clone(), made.clone(), call.clone(), pool.clone());
        tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let body = json!({ "poolId": pool, "gpus": 1, "durationS": 2 });
                match call("reservations.create", format!("r{i}"), body).await {
                    Ok(r) => made.lock().unwrap().reservations.push(r["reservationId"].as_str().unwrap().to_owned()),
                    Err(e) => made.lock().unwrap().refused.push(e),
                }
                i += 1;
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        })
    };
    // Writers as the three-kill test has them, fewer: acknowledged writes across this kill.
    let seen = Arc::new(Mutex::new(Seen::default()));
    let counts = Arc::new(Counts::default());
    let writers: Vec<_> = (0..FAILOVER_WRITERS)
        .map(|w| tokio::spawn(writer(w, url.clone(), token.clone(), stop.clone(), seen.clone(), counts.clone())))
        .collect();
    let progress = || {
        let made = made.lock().unwrap();
        (made.reservations.len(), receiver.received().len())
    };

    // Work done on the first primary, then the kill with deliveries in flight.
    wait_until("work before the kill", Duration::from_secs(60), || {
        let (r, d) = progress();
        (r >= 15 && d >= 40).then_some(())
    });
    let leader = wait_until("a primary", Duration::from_secs(60), || cluster.leader());
    // The machines answer pings; then they freeze (SIGSTOP: sessions open, nothing answered)
    // with pings queued whose deadlines pass while there is no primary, and their leases lapse
    // after the kill: the liveness reconciler's work, done by whichever gateway gets to it.
    let answered: Vec<String> = agent_nodes.iter().map(|n| ping(format!("ping-before-{n}"), n, 60)).collect();
    wait_until("pings answered before the kill", Duration::from_secs(60), || commands_in(&answered, "succeeded"));
    made.lock().unwrap().answered.extend(answered);
    agents.signal("STOP");
    let frozen: Vec<String> = agent_nodes
        .iter()
        .flat_map(|n| (0..2).map(move |i| (n, i)))
        .map(|(n, i)| ping(format!("ping-frozen-{n}-{i}"), n, 2))
        .collect();
    made.lock().unwrap().commands.extend(frozen.iter().cloned());
    let kill_ms = bc_tests::now_ms();
    let at = Instant::now();
    cluster.kill(leader);
    let at_kill = progress();
    eprintln!("killed member-{leader} (primary) with {at_kill:?} (reservations, receipts)");
    let new_leader =
        wait_until("a new primary", Duration::from_secs(cluster.ttl + 60), || cluster.leader().filter(|l| *l != leader));
    wait_until("work after the kill", Duration::from_secs(cluster.ttl + 60), || {
        let (r, d) = progress();
        let writes = seen.lock().unwrap().acked.iter().filter(|(_, _, t)| *t > at + Duration::from_millis(500)).count();
        (r >= at_kill.0 + 15 && d >= at_kill.1 + 40 && writes >= 50).then_some(())
    });
    eprintln!("member-{new_leader} is the primary; work resumed {:?} after the kill", at.elapsed());
    // The liveness reconciler on the new primary: the frozen machines' pings failed at their
    // deadlines and the machines unreachable; continued, they are ready again and answer.
    wait_until("the frozen machines' pings failed", Duration::from_secs(cluster.ttl + 60), || commands_in(&frozen, "failed"));
    wait_until("the frozen machines unreachable", Duration::from_secs(cluster.ttl + 60), || nodes_in("unreachable"));
    agents.signal("CONT");
    wait_until("the machines ready again", Duration::from_secs(120), || nodes_in("ready"));
    let answered: Vec<String> = agent_nodes.iter().map(|n| ping(format!("ping-after-{n}"), n, 60)).collect();
    wait_until("pings answered after the kill", Duration::from_secs(60), || commands_in(&answered, "succeeded"));
    made.lock().unwrap().answered.extend(answered);
    eprintln!("the machines were unreachable and ready again {:?} after the kill", at.elapsed());
    stop.store(true, Ordering::Relaxed);
    reserver.await.unwrap();
    for writer in writers {
        writer.await.unwrap();
    }
    let made = std::mem::take(&mut *made.lock().unwrap());
    assert!(made.refused.is_empty(), "work refused or given up on: {:?}", made.refused);
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    let gap = write_gaps(&seen, &[at], cluster.ttl)[0];

    // Every piece of work finished: each reservation expired, each command failed, each
    // delivery done.
    let (client, connection) = tokio_postgres::connect(cluster.var("HA_DATABASE_URL"), tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    let streams = |kind: &str, ids: &[String]| ids.iter().map(|id| format!("{kind}/{id}")).collect::<Vec<_>>();
    let (reservation_streams, command_streams) = (streams("reservation", &made.reservations), streams("command", &made.commands));
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let row = client
            .query_one(
                "SELECT (SELECT count(DISTINCT stream) FROM events WHERE type = 'reservation.expired' AND stream = ANY($1)), \
                 (SELECT count(DISTINCT stream) FROM events WHERE type = 'command.failed' AND stream = ANY($2)), \
                 (SELECT count(*) FROM work_items WHERE consumer = 'webhooks' AND state <> 'done'), \
                 (SELECT count(*) FROM events WHERE type LIKE 'reservation.%' OR type LIKE 'command.%') \
                 - (SELECT count(*) FROM work_items WHERE consumer = 'webhooks')",
                &[&reservation_streams, &command_streams],
            )
            .await
            .unwrap();
        let (expired, failed, pending, unfanned): (i64, i64, i64, i64) = (row.get(0), row.get(1), row.get(2), row.get(3));
        if expired as usize == made.reservations.len() && failed as usize == made.commands.len() && pending == 0 && unfanned == 0
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not finished 120 s after the load: {expired} of {} reservations expired, {failed} of {} commands failed, \
             {pending} deliveries not done, {unfanned} events with no delivery yet",
            made.reservations.len(),
            made.commands.len()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // The writes: every acknowledged one in the log, none twice, each answered, within the TTL
    // plus 10 s of the kill.
    let (lost, twice) = lost_and_twice(&client, &seen).await;
    eprintln!(
        "writes across one failover: ttl {} s; {} acknowledged, {} lost, {} twice, {} refused, {} unresolved; \
         {} indeterminate answers retried with their keys; write gap {gap:.1} s",
        cluster.ttl,
        seen.acked.len(),
        lost.len(),
        twice.len(),
        seen.refused.len(),
        seen.unresolved.len(),
        counts.indeterminate.load(Ordering::Relaxed)
    );
    assert!(lost.is_empty(), "acknowledged writes lost: {:?}", &lost[..lost.len().min(20)]);
    assert!(twice.is_empty(), "writes made twice: {twice:?}");
    assert!(seen.refused.is_empty(), "failures reported as plain: {:?}", &seen.refused[..seen.refused.len().min(20)]);
    assert!(seen.unresolved.is_empty(), "every write retried with its key was answered");
    assert!(gap <= (cluster.ttl + 10) as f64, "writes resumed {gap:.1} s after the kill, past the TTL + 10 s");

    // From the log: each piece of work once.
    let counted = client
        .query(
            "SELECT stream, type, count(*), max(at_ms) FROM events \
             WHERE type IN ('reservation.activated', 'reservation.expired', 'reservation.requeued', 'command.failed', \
             'command.succeeded') \
             GROUP BY stream, type",
            &[],
        )
        .await
        .unwrap();
    let mut events: HashMap<(String, String), (i64, i64)> = HashMap::new();
    for row in counted {
        events.insert((row.get(0), row.get(1)), (row.get(2), row.get(3)));
    }
    let twice: Vec<_> = events.iter().filter(|(_, (n, _))| *n > 1).collect();
    assert!(twice.is_empty(), "work done twice: {twice:?}");
    let once = |stream: &String, kind: &str| events.get(&(stream.clone(), kind.to_owned())).map_or(0, |(n, _)| *n) == 1;
    for stream in &reservation_streams {
        assert!(
            once(stream, "reservation.activated") && once(stream, "reservation.expired"),
            "{stream} activated and expired once"
        );
    }
    for stream in &command_streams {
        assert!(once(stream, "command.failed"), "{stream} failed once at its deadline");
        assert!(!events.contains_key(&(stream.clone(), "command.succeeded".into())), "{stream} failed and also succeeded");
    }
    for stream in streams("command", &made.answered) {
        assert!(once(&stream, "command.succeeded"), "{stream} answered once");
        assert!(!events.contains_key(&(stream.clone(), "command.failed".into())), "{stream} answered and also failed");
    }
    // Each machine's reachability as the log tells it: never the same change twice in a row
    // (a second `node.unreachable` or `node.ready` is a second reconciler doing the same
    // work), and after the kill it went unreachable and came back.
    let node_streams = streams("node", &agent_nodes);
    let changes = client
        .query(
            "SELECT stream, type, at_ms FROM events WHERE stream = ANY($1) AND type IN ('node.ready', 'node.unreachable') \
             ORDER BY stream, version",
            &[&node_streams],
        )
        .await
        .unwrap();
    let mut reachability: BTreeMap<String, Vec<(String, i64)>> = BTreeMap::new();
    for row in changes {
        reachability.entry(row.get(0)).or_default().push((row.get(1), row.get(2)));
    }
    for stream in &node_streams {
        let changes = reachability.get(stream).map(Vec::as_slice).unwrap_or_default();
        let repeated = changes.windows(2).find(|w| w[0].0 == w[1].0);
        assert!(repeated.is_none(), "{stream}: the same change twice in a row: {changes:?}");
        let after: Vec<&str> = changes.iter().filter(|(_, at)| *at as u64 > kill_ms).map(|(t, _)| t.as_str()).collect();
        assert!(after.starts_with(&["node.unreachable", "node.ready"]), "{stream} after the kill: {after:?}");
    }
    let after_kill = |kind: &str| events.iter().filter(|((_, t), (_, at))| t == kind && *at as u64 > kill_ms).count();
    let (activated_after, failed_after) = (after_kill("reservation.activated"), after_kill("command.failed"));
    assert!(activated_after > 0, "the reconcilers worked on after the failover");
    assert_eq!(failed_after, command_streams.len(), "every frozen ping failed after the kill, once the primary was back");

    // From the receiver and the delivery records: every event delivered, and no receipt without
    // its recorded attempt.
    let tenant: String = client
        .query_one("SELECT tenant_id FROM events WHERE stream = $1 LIMIT 1", &[&reservation_streams[0]])
        .await
        .unwrap()
        .get(0);
    let subscribed: Vec<String> = client
        .query("SELECT id FROM events WHERE tenant_id = $1 AND (type LIKE 'reservation.%' OR type LIKE 'command.%')", &[&tenant])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let attempts: HashMap<String, (String, i64)> = client
        .query(
            "SELECT i.id, i.state, (SELECT count(*) FROM work_attempts a \
             WHERE a.tenant_id = i.tenant_id AND a.consumer = i.consumer AND a.item_id = i.id) \
             FROM work_items i WHERE i.consumer = 'webhooks'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2))))
        .collect();
    let mut receipts: HashMap<String, usize> = HashMap::new();
    let got = receiver.received();
    for r in &got {
        *receipts.entry(r.id.clone()).or_default() += 1;
    }
    let mut unrecorded = Vec::new();
    for event in &subscribed {
        let item = bc_projections::webhook_delivery_id(event, &webhook);
        let (state, recorded) = attempts.get(&item).cloned().unwrap_or_else(|| panic!("no delivery of {event}"));
        let received = receipts.get(event).copied().unwrap_or(0);
        assert_eq!(state, "done", "{item}");
        assert!(received >= 1, "{event} never reached the receiver");
        if received as i64 > recorded {
            unrecorded.push(format!("{event}: received {received}, {recorded} attempt(s) recorded"));
        }
    }
    let retried = attempts.values().filter(|(_, n)| *n > 1).count();
    let received_after = got.iter().filter(|r| r.at_ms > kill_ms).count();

    // Both gateways ran the reconcilers.
    let (code, out, err) =
        bc_tests::cli(&["reconcilers", "status", "--database-url", cluster.var("HA_DATABASE_URL"), "--format", "json"], &[]);
    assert_eq!(code, 0, "{err}");
    let rows = bc_tests::json(&out)["items"].as_array().cloned().unwrap_or_default();
    let instances = |name: &str| {
        rows.iter()
            .filter(|r| r["name"] == name && r["passes"].as_u64().unwrap_or(0) > 0)
            .map(|r| r["instance"].to_string())
            .collect::<HashSet<_>>()
    };
    let verify = Command::new(&cluster.binary)
        .args(["audit", "verify", "--database-url", cluster.var("HA_DATABASE_URL"), "--data-dir", cluster.var("HA_DATA_DIR")])
        .output()
        .unwrap();
    eprintln!(
        "reconcilers across one failover: {} reservations (activated and expired once each; {activated_after} activated after the kill), \
         {} commands (failed once each at their deadline; {failed_after} after the kill), {} events delivered with {} receipts \
         ({received_after} after the kill; {retried} deliveries attempted more than once), {} receipts past their recorded attempts; \
         processes: reservations {}, liveness {}, webhooks {}",
        made.reservations.len(),
        made.commands.len(),
        subscribed.len(),
        got.len(),
        unrecorded.len(),
        instances("reservations").len(),
        instances("liveness").len(),
        instances("webhooks").len(),
    );
    assert!(unrecorded.is_empty(), "deliveries received more often than their attempts were recorded: {unrecorded:?}");
    // Both run each pass-driven reconciler; the webhooks consumer records a process only once
    // it delivered something, and one process may have claimed every item.
    for name in ["reservations", "liveness"] {
        assert!(instances(name).len() >= 2, "both gateways run {name}: {rows:#?}");
    }
    assert!(!instances("webhooks").is_empty(), "the webhooks consumer recorded its deliveries: {rows:#?}");
    assert!(verify.status.success(), "audit verify: {}", String::from_utf8_lossy(&verify.stderr));
}
