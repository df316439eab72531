//! `make bench` (watch): write → watcher latency with 1 and with 1,000 connected watchers, and
//! the write's own latency with 0 and with 1,000, for `GET /watch` and, driven by the same
//! harness in the same run, for etcd (Debian's `etcd-server`, which `make bench` installs: its
//! v3 JSON gateway, `POST /v3/watch` streaming and `POST /v3/kv/put`). Then goal 1's targets
//! as ratios: our p99 with 1,000 watchers ÷ etcd's (≤ 1.0), and our write latency with 1,000
//! watchers ÷ with none (≤ 1.5).
//!
//! The harness, the same for both: one client process (this one, its own 2-thread runtime) with
//! reqwest over HTTP/1.1 on loopback; every watcher its own connection and stream; writes one
//! at a time on a connection of their own, from a thread and runtime of their own (a writer is
//! not its watchers' process), on one schedule for every case: a write every
//! [`WRITE_INTERVAL_MS`], or, when one takes longer to reach every watcher, once it has. So
//! the write latencies compared are at the same write rate. (Before, each write followed the
//! previous one's fan-out at once: with no watcher the writes ran back to back on cores the
//! write before had just left hot, 0.29 ms at p50, while with 1,000 each came after a fan-out
//! of several milliseconds, 0.59 ms; given the same 5 to 20 ms pause after each write, the two
//! were 0.69 to 0.86 ms and 0.84 to 1.25 ms.) Each system is started once and its three cases
//! (0, 1 and 1,000 watchers) are measured in [`TURNS`] turns, a share of the writes each, so a
//! machine that speeds up or slows down during the run moves every case alike: run one after
//! the other, the no-watcher write's p50 moved from 0.75 to 1.10 ms between runs of one build.
//!
//! A write's latency is request to response; write → watcher is the write's request to the
//! moment a watcher has the event in hand (found in the bytes it read; neither side's JSON is
//! parsed, so the client's cost is the same for both). Ours is the gateway on a fresh SQLite
//! database (`synchronous = FULL`), served in this process on a runtime of its own (2 threads,
//! no reconcilers); each write is `pools.create`, a signed, chained, projected event. etcd runs
//! as its own process with its defaults (one member, its WAL fsynced), started in a fresh temp
//! directory; each write is a put of a value about as long as our event's frame, under a prefix
//! the watchers watch. `BC_BENCH_ETCD` names the binary (default `etcd` on `PATH`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use bc_gateway::watch::{WATCHERS_MAX, WatcherLimits, WatcherSlots};
use futures::StreamExt;

use crate::support::etcd;
use crate::support::gateway;
use etcd::{EtcdServer, etcd_version};

/// Writes measured per case, in [`TURNS`] turns of `WRITES / TURNS`, each turn's after
/// `WARMUP_WRITES` that are not (the first of which also ends, on the server, the watchers
/// the turn before let go).
const WRITES: usize = 500;
const TURNS: usize = 5;
const WARMUP_WRITES: usize = 10;
const _: () = assert!(WRITES.is_multiple_of(TURNS));
/// One write starts this long after the one before it started (or once that one has reached
/// every watcher, if later): longer than a fan-out to 1,000 watchers takes here at p99 (about
/// 9 to 14 ms), so the schedule, not the fan-out, paces every case alike.
const WRITE_INTERVAL_MS: u64 = 20;
/// The many-watchers case of the goals.
const MANY_WATCHERS: usize = 1000;
const _: () = assert!(MANY_WATCHERS <= WATCHERS_MAX);
/// How long one write may take to reach every watcher before the run fails.
const FAN_OUT_TIMEOUT_S: u64 = 30;
/// etcd's key prefix, and the length of each put's value (about our `pool.created` frame's).
const ETCD_PREFIX: &str = "bench/";
const ETCD_VALUE_BYTES: usize = 245;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Which system a run measures: how to write to it, watch it, and find a write in what a
/// watcher read.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Ours,
    Etcd,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Ours => "better-compute",
            Kind::Etcd => "etcd",
        }
    }

    /// Where one message ends: SSE events end with a blank line, etcd's JSON messages with a
    /// line break.
    fn delimiter(self) -> &'static [u8] {
        match self {
            Kind::Ours => b"\n\n",
            Kind::Etcd => b"\n",
        }
    }

    /// Which write a message is, if it is one; or that it confirms the watch (etcd's `created`).
    fn parse(self, message: &[u8]) -> Message {
        let text = String::from_utf8_lossy(message);
        match self {
            Kind::Ours => {
                let Some(at) = text.find("\"name\":\"w") else { return Message::Other };
                let digits: String = text[at + 9..].chars().take_while(char::is_ascii_digit).collect();
                digits.parse().map_or(Message::Other, Message::Write)
            }
            Kind::Etcd => {
                let Some(at) = text.find("\"key\":\"") else {
                    return if text.contains("\"created\":true") { Message::Created } else { Message::Other };
                };
                let key = &text[at + 7..];
                let key = &key[..key.find('"').unwrap_or(key.len())];
                let key = String::from_utf8(B64.decode(key).unwrap_or_default()).unwrap_or_default();
                key.strip_prefix(&format!("{ETCD_PREFIX}w")).and_then(|i| i.parse().ok()).map_or(Message::Other, Message::Write)
            }
        }
    }
}

/// Where a system is served, and (for ours) the administrator's token.
#[derive(Clone)]
struct Endpoint {
    kind: Kind,
    url: String,
    token: String,
}

/// A running system.
struct Target {
    endpoint: Endpoint,
    _server: Server,
}

enum Server {
    Ours(#[allow(dead_code)] OurServer),
    Etcd(#[allow(dead_code)] EtcdServer),
}

impl Target {
    /// Starts a fresh server: ours on its own runtime, etcd as a process (`client` waits for it).
    fn start(kind: Kind, client: &tokio::runtime::Runtime) -> Target {
        match kind {
            Kind::Ours => {
                let (url, token, server) = OurServer::start();
                Target { endpoint: Endpoint { kind, url, token }, _server: Server::Ours(server) }
            }
            Kind::Etcd => {
                let (url, server) = client.block_on(EtcdServer::start());
                Target { endpoint: Endpoint { kind, url, token: String::new() }, _server: Server::Etcd(server) }
            }
        }
    }
}

impl Endpoint {
    async fn write(&self, http: &reqwest::Client, i: usize) {
        let url = &self.url;
        let response = match self.kind {
            Kind::Ours => http
                .post(format!("{url}/api/compute/pools.create"))
                .bearer_auth(&self.token)
                .json(&serde_json::json!({ "name": format!("w{i}") }))
                .send()
                .await
                .unwrap(),
            Kind::Etcd => {
                let value = format!("w{i}:{}", "x".repeat(ETCD_VALUE_BYTES));
                let body = serde_json::json!({ "key": B64.encode(format!("{ETCD_PREFIX}w{i}")), "value": B64.encode(value) });
                http.post(format!("{url}/v3/kv/put")).json(&body).send().await.unwrap()
            }
        };
        let status = response.status();
        let body = response.bytes().await.unwrap();
        assert!(status.is_success(), "{} write {i}: {status} {}", self.kind.name(), String::from_utf8_lossy(&body));
    }

    async fn watch(&self, http: &reqwest::Client) -> reqwest::Response {
        let url = &self.url;
        let response = match self.kind {
            Kind::Ours => http.get(format!("{url}/watch?types=pool.*")).bearer_auth(&self.token).send().await,
            Kind::Etcd => {
                let key = B64.encode(ETCD_PREFIX);
                let range_end = B64.encode(format!("{}0", ETCD_PREFIX.trim_end_matches('/')));
                let body = serde_json::json!({ "create_request": { "key": key, "range_end": range_end } });
                http.post(format!("{url}/v3/watch")).json(&body).send().await
            }
        }
        .unwrap();
        assert!(response.status().is_success(), "{} watch: {}", self.kind.name(), response.status());
        response
    }
}

enum Message {
    Write(usize),
    Created,
    Other,
}

/// When each write reached each watcher.
struct Arrivals {
    at: Mutex<HashMap<usize, Vec<Instant>>>,
    watchers: usize,
    complete: tokio::sync::Notify,
    created: AtomicUsize,
    bytes: AtomicUsize,
    messages: AtomicUsize,
}

impl Arrivals {
    fn record(&self, i: usize, length: usize) {
        let now = Instant::now();
        self.bytes.fetch_add(length, Ordering::Relaxed);
        self.messages.fetch_add(1, Ordering::Relaxed);
        let mut at = self.at.lock().unwrap();
        let times = at.entry(i).or_default();
        times.push(now);
        if times.len() == self.watchers {
            self.complete.notify_waiters();
        }
    }

    fn count(&self, i: usize) -> usize {
        self.at.lock().unwrap().get(&i).map_or(0, Vec::len)
    }
}

/// One run's figures: the writes' latencies, and write → watcher over every (write, watcher).
#[derive(Default)]
struct Figures {
    write_ms: Vec<f64>,
    watcher_ms: Vec<f64>,
    frame_bytes: usize,
}

/// The writing client: a thread and a runtime of its own, as a writer is a process apart from its
/// watchers, so this process's reading of 1,000 streams does not hold up reading a write's
/// answer (the two still share the machine's cores). Each request names a write and is answered
/// with when it was sent and how long it took.
type WriteRequest = (usize, tokio::sync::oneshot::Sender<(Instant, Duration)>);

fn writer(endpoint: Endpoint) -> (tokio::sync::mpsc::Sender<WriteRequest>, std::thread::JoinHandle<()>) {
    let (requests, mut received) = tokio::sync::mpsc::channel::<WriteRequest>(1);
    let thread = std::thread::Builder::new().name("writer".into()).spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async move {
            let http = reqwest::Client::new();
            while let Some((i, answer)) = received.recv().await {
                let started = Instant::now();
                endpoint.write(&http, i).await;
                let _ = answer.send((started, started.elapsed()));
            }
        });
    });
    (requests, thread.unwrap())
}

/// One turn of one case: `watchers` watchers connected, then `writes` writes measured after the
/// warm-up, named from `first` on (names are unique on a server across turns), then the
/// watchers let go.
async fn run(target: &Target, watchers: usize, first: usize, writes: usize) -> Figures {
    let target = &target.endpoint;
    let arrivals = Arc::new(Arrivals {
        at: Mutex::default(),
        watchers,
        complete: tokio::sync::Notify::new(),
        created: AtomicUsize::new(0),
        bytes: AtomicUsize::new(0),
        messages: AtomicUsize::new(0),
    });
    // Every watcher on a connection of its own; the writes on one more, from their own thread.
    let watch_http = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let (write, write_thread) = writer(target.clone());
    let mut readers = Vec::new();
    for _ in 0..watchers {
        let response = target.watch(&watch_http).await;
        let (arrivals, kind) = (arrivals.clone(), target.kind);
        let delimiter = kind.delimiter();
        readers.push(tokio::spawn(async move {
            let mut body = response.bytes_stream();
            let mut buffer = Vec::new();
            while let Some(Ok(chunk)) = body.next().await {
                buffer.extend_from_slice(&chunk);
                while let Some(end) = buffer.windows(delimiter.len()).position(|w| w == delimiter) {
                    let message: Vec<u8> = buffer.drain(..end + delimiter.len()).collect();
                    match kind.parse(&message) {
                        Message::Write(i) => arrivals.record(i, message.len()),
                        Message::Created => {
                            arrivals.created.fetch_add(1, Ordering::Relaxed);
                        }
                        Message::Other => {}
                    }
                }
            }
        }));
    }
    // etcd confirms each watch with a `created` message; ours is registered once its response
    // is answered (it starts at the log's end as of then).
    if target.kind == Kind::Etcd {
        let deadline = Instant::now() + Duration::from_secs(FAN_OUT_TIMEOUT_S);
        while arrivals.created.load(Ordering::Relaxed) < watchers {
            assert!(
                Instant::now() < deadline,
                "etcd confirmed {} of {watchers} watches",
                arrivals.created.load(Ordering::Relaxed)
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let mut figures = Figures::default();
    let interval = Duration::from_millis(WRITE_INTERVAL_MS);
    let mut next_write = tokio::time::Instant::now();
    for i in first..first + WARMUP_WRITES + writes {
        tokio::time::sleep_until(next_write).await;
        next_write = tokio::time::Instant::now() + interval;
        let (answer, answered) = tokio::sync::oneshot::channel();
        write.send((i, answer)).await.unwrap();
        let (started, written) = answered.await.expect("the writer answers");
        if watchers > 0 && arrivals.count(i) < watchers {
            let waited = tokio::time::timeout(Duration::from_secs(FAN_OUT_TIMEOUT_S), async {
                while arrivals.count(i) < watchers {
                    let next = arrivals.complete.notified();
                    tokio::pin!(next);
                    next.as_mut().enable();
                    if arrivals.count(i) >= watchers {
                        break;
                    }
                    next.await;
                }
            })
            .await;
            assert!(waited.is_ok(), "{} write {i} reached {} of {watchers} watchers", target.kind.name(), arrivals.count(i));
        }
        let times = arrivals.at.lock().unwrap().remove(&i).unwrap_or_default();
        if i < first + WARMUP_WRITES {
            continue;
        }
        figures.write_ms.push(ms(written));
        figures.watcher_ms.extend(times.iter().map(|t| ms(t.saturating_duration_since(started))));
    }
    assert_eq!(figures.watcher_ms.len(), writes * watchers, "every watcher got every write once");
    let messages = arrivals.messages.load(Ordering::Relaxed);
    figures.frame_bytes = arrivals.bytes.load(Ordering::Relaxed).checked_div(messages).unwrap_or(0);
    for reader in readers {
        reader.abort();
    }
    drop(write);
    write_thread.join().unwrap();
    figures
}

/// The gateway on a fresh SQLite database, served on a runtime of its own.
struct OurServer {
    runtime: Option<tokio::runtime::Runtime>,
    _dir: tempfile::TempDir,
}

impl OurServer {
    fn start() -> (String, String, Self) {
        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(2).thread_name("server").enable_all().build().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.sqlite3");
        let (url, token) = runtime.block_on(async move {
            // Every watcher uses the one administrator key, so the per-key and per-tenant
            // limits are raised to the total: what is measured is one tenant's events fanned
            // out to 1,000 watchers, the tail's worst case (by default a tenant holds 64).
            let server = gateway::start(&path, |state| {
                state.watchers =
                    WatcherSlots::new(WatcherLimits { total: WATCHERS_MAX, per_tenant: WATCHERS_MAX, per_key: WATCHERS_MAX });
            })
            .await;
            (server.url, server.token)
        });
        (url, token, Self { runtime: Some(runtime), _dir: dir })
    }
}

impl Drop for OurServer {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// So 2,000 sockets (1,000 watchers' on each side) fit: the soft open-file limit raised to the
/// hard one.
fn raise_open_file_limit() {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    if let (Some(current), Some(maximum)) = (limit.current, limit.maximum)
        && current < maximum
    {
        let _ = setrlimit(Resource::Nofile, Rlimit { current: Some(maximum), maximum: Some(maximum) });
    }
    let now = getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX);
    assert!(now >= 4 * MANY_WATCHERS as u64, "the open-file limit is {now}; hint: ulimit -n {}", 4 * MANY_WATCHERS);
}

struct Line {
    kind: Kind,
    system: String,
    watchers: usize,
    figures: Figures,
}

pub fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    raise_open_file_limit();
    let version = etcd_version();
    let client =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).thread_name("client").enable_all().build().unwrap();
    let mut lines: Vec<Line> = Vec::new();
    const CASES: [usize; 3] = [0, 1, MANY_WATCHERS];
    let per_turn = WRITES / TURNS;
    for kind in [Kind::Ours, Kind::Etcd] {
        let target = Target::start(kind, &client);
        let mut cases: Vec<Figures> = CASES.iter().map(|_| Figures::default()).collect();
        let mut first = 0;
        for turn in 1..=TURNS {
            for (case, watchers) in cases.iter_mut().zip(CASES) {
                eprintln!(
                    "watch benchmark: {} with {watchers} watcher(s), turn {turn} of {TURNS}, {per_turn} writes",
                    kind.name()
                );
                let figures = client.block_on(run(&target, watchers, first, per_turn));
                first += WARMUP_WRITES + per_turn;
                case.write_ms.extend(figures.write_ms);
                case.watcher_ms.extend(figures.watcher_ms);
                case.frame_bytes = case.frame_bytes.max(figures.frame_bytes);
            }
        }
        let system = if kind == Kind::Ours { kind.name().to_owned() } else { version.replace("etcd Version: ", "etcd ") };
        for (mut figures, watchers) in cases.into_iter().zip(CASES) {
            figures.write_ms.sort_by(f64::total_cmp);
            figures.watcher_ms.sort_by(f64::total_cmp);
            lines.push(Line { kind, system: system.clone(), watchers, figures });
        }
    }
    println!();
    println!("| system | watchers | write p50 / p99 (ms) | write → watcher p50 / p99 (ms) | bytes per event |");
    println!("|---|---:|---:|---:|---:|");
    for line in &lines {
        let f = &line.figures;
        let (w50, w99) = (percentile(&f.write_ms, 0.5), percentile(&f.write_ms, 0.99));
        let watcher = if f.watcher_ms.is_empty() {
            "—".to_owned()
        } else {
            format!("{:.2} / {:.2}", percentile(&f.watcher_ms, 0.5), percentile(&f.watcher_ms, 0.99))
        };
        let bytes = if f.frame_bytes == 0 { "—".to_owned() } else { f.frame_bytes.to_string() };
        println!("| {} | {} | {w50:.2} / {w99:.2} | {watcher} | {bytes} |", line.system, line.watchers);
    }
    let find = |kind: Kind, watchers: usize| &lines.iter().find(|l| l.kind == kind && l.watchers == watchers).unwrap().figures;
    let p99 = |v: &[f64]| percentile(v, 0.99);
    let p50 = |v: &[f64]| percentile(v, 0.5);
    let fan_out = p99(&find(Kind::Ours, MANY_WATCHERS).watcher_ms) / p99(&find(Kind::Etcd, MANY_WATCHERS).watcher_ms);
    let write_p50 = p50(&find(Kind::Ours, MANY_WATCHERS).write_ms) / p50(&find(Kind::Ours, 0).write_ms);
    let write_p99 = p99(&find(Kind::Ours, MANY_WATCHERS).write_ms) / p99(&find(Kind::Ours, 0).write_ms);
    let verdict = |ratio: f64, goal: f64| if ratio <= goal { "met" } else { "MISSED" };
    println!();
    println!("| goal 1 | ratio | target | |");
    println!("|---|---:|---:|---|");
    println!(
        "| write → watcher p99, {MANY_WATCHERS} watchers: ours ÷ etcd's | {fan_out:.2} | ≤ 1.0 | {} |",
        verdict(fan_out, 1.0)
    );
    println!("| our write p50, {MANY_WATCHERS} watchers ÷ none | {write_p50:.2} | ≤ 1.5 | {} |", verdict(write_p50, 1.5));
    println!("| our write p99, {MANY_WATCHERS} watchers ÷ none | {write_p99:.2} | ≤ 1.5 | {} |", verdict(write_p99, 1.5));
}
