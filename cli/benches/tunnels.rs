//! `make bench` (tunnels): tunnels through the gateway and the node's agent, with the release
//! `better-compute dev` and the release `bcd` of a `fakehw` build (which `make bench` builds
//! first) as child processes, on loopback: a fake machine whose guests are this machine's
//! loopback (`[hardware] fake_guest_address`), its serial console a TCP server of the bench
//! (`fake_guest_console`), and one running instance.
//! - `forward`: `FORWARD_BYTES` up (local → guest) and down (guest → local) through
//!   `better-compute forward`, beside the same transfers on raw loopback TCP to the guest's
//!   server in the same run, the best of `TRANSFER_RUNS` each: the ratio (goal at least 0.5),
//!   and the CPU time of the gateway, the agent and the CLI meanwhile.
//! - `console --instance`: `KEYSTROKES` single keystrokes, each sent once the last came back
//!   (the guest's console echoes it), through the CLI's standard input and output: the round
//!   trip's p50 and p99 (goal p99 under 5 ms).
//! - The gateway's memory per open tunnel: its RSS with `MEMORY_NODES` × `TUNNELS_PER_NODE`
//!   idle `console --node` tunnels open (the bench's own WebSocket clients), less its RSS
//!   before, over their number.

use crate::support::banner;

use std::io::{BufRead, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;

/// Bytes each way per transfer, and transfers each way (the best is kept: the machine is shared).
const FORWARD_BYTES: usize = 1 << 30;
const TRANSFER_RUNS: usize = 3;
/// Keystrokes timed.
const KEYSTROKES: usize = 2_000;
/// Nodes whose consoles are held open for the memory figure, and tunnels per node (the most a
/// node carries: `dev --tunnels-per-node-max` is at most 7).
const MEMORY_NODES: usize = 16;
const TUNNELS_PER_NODE: usize = 7;
/// How long the gateway is left to settle before its memory is read.
const SETTLE_MS: u64 = 1_500;

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn rss_kib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.split_whitespace().next()).unwrap().parse().unwrap()
}

/// CPU seconds `pid` has used (user and system, every thread), from `/proc` (USER_HZ = 100).
fn cpu_s(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command's name (which may hold spaces), from the third on.
    let fields: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    ticks as f64 / 100.0
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// The `bcd` beside the bench's `better-compute`: a `fakehw` build (`make bench` builds it).
fn bcd() -> PathBuf {
    let path = Path::new(env!("CARGO_BIN_EXE_better-compute")).with_file_name("bcd");
    let fake = Command::new(&path).args(["hardware", "--fake-hw", "1"]).stdout(Stdio::null()).stderr(Stdio::null()).status();
    assert!(
        fake.is_ok_and(|s| s.success()),
        "{} is not a fakehw build\nhint: cargo build --release -p bc-agent --features fakehw --bin bcd (make bench does)",
        path.display()
    );
    path
}

/// `better-compute dev` as a child: (child, http url, agents' port, serving pin, log key pin).
fn start_gateway(dir: &Path) -> (Killed, String, u16, String, String) {
    let agents_port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_better-compute"))
        .args(["dev", "--data-dir", &dir.display().to_string(), "--listen", "127.0.0.1:0"])
        .args(["--agents-listen", &format!("127.0.0.1:{agents_port}")])
        .args(["--tunnels-per-node-max", &TUNNELS_PER_NODE.to_string(), "--tunnels-per-key-max", "1024"])
        .args(["--tunnels-per-tenant-max", "1024"])
        .env("BETTER_COMPUTE_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (url, serving_pin, log_pin) = banner::read(child.stdout.take().unwrap());
    (Killed(child), url, agents_port, serving_pin, log_pin)
}

/// The API, as the root administrator.
struct Api {
    http: reqwest::Client,
    url: String,
    token: String,
}

impl Api {
    async fn call(&self, method: &str, body: Value) -> Value {
        let r = self
            .http
            .post(format!("{}/api/compute/{method}", self.url))
            .bearer_auth(&self.token)
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status();
        let v: Value = r.json().await.unwrap();
        assert!(status.is_success(), "{method}: {v}");
        v
    }

    /// Polls `method` until `done` says yes (30 s at most).
    async fn wait(&self, method: &str, body: Value, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let doc = self.call(method, body.clone()).await;
            if done(&doc) {
                return doc;
            }
            assert!(Instant::now() < deadline, "not {what} after 30 s: {doc}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// A fake machine running `bcd node`: joined to `pool` and live; its node id.
async fn start_node(
    api: &Api,
    bcd: &Path,
    dir: &Path,
    gateway: (u16, &str, &str),
    hardware: &str,
    pool: &str,
) -> (Killed, String) {
    let (agents_port, serving_pin, log_pin) = gateway;
    std::fs::create_dir_all(dir).unwrap();
    let config = dir.join("config.toml");
    std::fs::write(
        &config,
        format!(
            "data_dir = {:?}\ngateway = \"https://127.0.0.1:{agents_port}\"\nserving_ca_spki_pin = {serving_pin:?}\nlog_key_pin = {log_pin:?}\n\n[log]\nlevel = \"warn\"\n\n{hardware}",
            dir.join("data").display().to_string()
        ),
    )
    .unwrap();
    let token = api.call("joinTokens.create", json!({ "poolId": pool, "uses": 1 })).await["token"].as_str().unwrap().to_owned();
    let mut join =
        Command::new(bcd).args(["join", "--config", &config.display().to_string()]).stdin(Stdio::piped()).spawn().unwrap();
    join.stdin.take().unwrap().write_all(format!("{token}\n").as_bytes()).unwrap();
    assert!(join.wait().unwrap().success(), "bcd join");
    let identity: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("data/identity.json")).unwrap()).unwrap();
    let node =
        serde_json::from_str::<Value>(identity["identity"].as_str().unwrap()).unwrap()["nodeId"].as_str().unwrap().to_owned();
    let child = Command::new(bcd)
        .args(["node", "--config", &config.display().to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    api.wait("nodes.get", json!({ "nodeId": node }), "ready", |d| d["state"] == "ready").await;
    (Killed(child), node)
}

/// `len` bytes that begin as a standalone qcow2 (no backing file), then noise.
fn qcow2_of(len: usize) -> Vec<u8> {
    let mut bytes: Vec<u8> = (0..len as u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    bytes[..112].fill(0);
    bytes[0..4].copy_from_slice(b"QFI\xfb");
    bytes[4..8].copy_from_slice(&3u32.to_be_bytes());
    bytes[20..24].copy_from_slice(&16u32.to_be_bytes());
    bytes[24..32].copy_from_slice(&(1u64 << 30).to_be_bytes());
    bytes[96..100].copy_from_slice(&4u32.to_be_bytes());
    bytes[100..104].copy_from_slice(&104u32.to_be_bytes());
    bytes
}

/// Serves `bytes` to every GET on a loopback port: the image's URL.
fn image_server(bytes: Vec<u8>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/guest.qcow2", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let mut head = Vec::new();
            let mut buffer = [0u8; 4096];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match stream.read(&mut buffer) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => head.extend_from_slice(&buffer[..n]),
                }
            }
            let _ = stream
                .write_all(format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n", bytes.len()).as_bytes());
            let _ = stream.write_all(&bytes);
        }
    });
    url
}

/// The instance on `pool`'s node, running.
async fn running_instance(api: &Api, pool: &str) -> String {
    let bytes = qcow2_of(256 * 1024);
    let sha256 = sha2_hex(&bytes);
    let url = image_server(bytes);
    let image =
        api.call("images.register", json!({ "name": "guest", "url": url, "sha256": sha256, "diskFormat": "qcow2" })).await;
    let flavor = api
        .call("flavors.create", json!({ "poolId": pool, "name": "small", "vcpus": 1, "memoryMiB": 512, "diskGiB": 1, "gpus": 1 }))
        .await;
    let rsv = api.call("reservations.create", json!({ "poolId": pool, "gpus": 1, "durationS": 3600 })).await;
    let rsv = rsv["reservationId"].as_str().unwrap().to_owned();
    api.wait("reservations.get", json!({ "reservationId": rsv }), "bound", |d| d["binding"]["state"] == "bound").await;
    let created = api
        .call(
            "instances.create",
            json!({ "name": "guest", "reservationId": rsv, "flavorId": flavor["flavorId"], "imageId": image["imageId"] }),
        )
        .await;
    let instance = created["instanceId"].as_str().unwrap().to_owned();
    api.wait("instances.get", json!({ "instanceId": instance }), "running", |d| d["state"] == "running").await;
    instance
}

fn sha2_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// The guest's transfer server: a connection's first byte asks `U` (it reads `FORWARD_BYTES`,
/// then answers one byte) or `D` (it writes `FORWARD_BYTES`).
fn transfer_server() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for socket in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut socket = socket;
                let mut ask = [0u8; 1];
                if socket.read_exact(&mut ask).is_err() {
                    return;
                }
                let mut buffer = vec![0u8; 1 << 20];
                if ask[0] == b'U' {
                    let mut left = FORWARD_BYTES;
                    while left > 0 {
                        match socket.read(&mut buffer[..left.min(1 << 20)]) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => left -= n,
                        }
                    }
                    let _ = socket.write_all(b"k");
                } else {
                    buffer.fill(0x5a);
                    for _ in 0..FORWARD_BYTES >> 20 {
                        if socket.write_all(&buffer).is_err() {
                            return;
                        }
                    }
                }
                // Held until the other end closes.
                let _ = socket.read(&mut ask);
            });
        }
    });
    port
}

/// `TRANSFER_RUNS` [`transfer_once`]s: MiB/s each way, in order.
fn transfer(address: SocketAddr) -> Vec<(f64, Option<f64>)> {
    (0..TRANSFER_RUNS).map(|_| transfer_once(address)).collect()
}

/// The best of `runs` each way (NaN down when every download was cut), and how many were cut.
fn best(runs: &[(f64, Option<f64>)]) -> ((f64, f64), usize) {
    let up = runs.iter().map(|r| r.0).fold(0.0, f64::max);
    let down = runs.iter().filter_map(|r| r.1).fold(f64::NAN, f64::max);
    ((up, down), runs.iter().filter(|r| r.1.is_none()).count())
}

fn listed(rates: impl Iterator<Item = Option<f64>>) -> String {
    rates.map(|r| r.map_or("cut".to_owned(), |r| format!("{r:.0}"))).collect::<Vec<_>>().join(", ")
}

/// Uploads then downloads `FORWARD_BYTES` through a connection to `address`: MiB/s each way,
/// none down when the download ended early: `forward` disconnects a local reader more than
/// 16 MiB behind (the reference's bound), which the bench's own reader can be when the
/// machine's cores are taken by other work.
fn transfer_once(address: SocketAddr) -> (f64, Option<f64>) {
    let mut buffer = vec![0xa5u8; 1 << 20];
    let mut up = TcpStream::connect(address).unwrap();
    let started = Instant::now();
    up.write_all(b"U").unwrap();
    for _ in 0..FORWARD_BYTES >> 20 {
        up.write_all(&buffer).unwrap();
    }
    let mut done = [0u8; 1];
    up.read_exact(&mut done).unwrap();
    let up_rate = (FORWARD_BYTES >> 20) as f64 / started.elapsed().as_secs_f64();
    drop(up);
    let mut down = TcpStream::connect(address).unwrap();
    let started = Instant::now();
    down.write_all(b"D").unwrap();
    let mut left = FORWARD_BYTES;
    while left > 0 {
        match down.read(&mut buffer) {
            Ok(n @ 1..) => left -= n,
            Ok(0) | Err(_) => {
                eprintln!("the download ended {left} bytes early");
                return (up_rate, None);
            }
        }
    }
    let down_rate = (FORWARD_BYTES >> 20) as f64 / started.elapsed().as_secs_f64();
    (up_rate, Some(down_rate))
}

/// The guest's serial console: echoes every byte at once.
fn echo_console() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for socket in listener.incoming().flatten() {
            let _ = socket.set_nodelay(true);
            std::thread::spawn(move || {
                let mut back = socket.try_clone().unwrap();
                let mut socket = socket;
                let _ = std::io::copy(&mut socket, &mut back);
            });
        }
    });
    address
}

/// `better-compute forward` to `port` of `instance`: the process and where it listens.
fn start_forward(api: &Api, instance: &str, port: u16) -> (Killed, SocketAddr) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_better-compute"))
        .args(["forward", "--instance", instance, "--port", &port.to_string(), "--local-port", "0"])
        .env("BETTER_COMPUTE_URL", &api.url)
        .env("BETTER_COMPUTE_TOKEN", &api.token)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let local = lines
        .by_ref()
        .map_while(Result::ok)
        .find_map(|l| l.strip_prefix("forwarding ").and_then(|rest| rest.split_whitespace().next()?.parse().ok()))
        .expect("forward prints where it listens");
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            eprintln!("{line}");
        }
    });
    (Killed(child), local)
}

/// `console --instance` with piped standard input and output: `KEYSTROKES` round trips, in ms,
/// sorted.
fn keystrokes(api: &Api, instance: &str) -> Vec<f64> {
    let mut child = Killed(
        Command::new(env!("CARGO_BIN_EXE_better-compute"))
            .args(["console", "--instance", instance])
            .env("BETTER_COMPUTE_URL", &api.url)
            .env("BETTER_COMPUTE_TOKEN", &api.token)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let mut keyboard = child.0.stdin.take().unwrap();
    let mut screen = child.0.stdout.take().unwrap();
    let mut one = [0u8; 1];
    // The first keystroke waits for the tunnel to open; it is not timed.
    keyboard.write_all(b"k").unwrap();
    screen.read_exact(&mut one).unwrap();
    let mut samples: Vec<f64> = (0..KEYSTROKES)
        .map(|_| {
            let started = Instant::now();
            keyboard.write_all(b"k").unwrap();
            screen.read_exact(&mut one).unwrap();
            started.elapsed().as_secs_f64() * 1000.0
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    keyboard.write_all(&[0x1d]).unwrap();
    let status = child.0.wait().unwrap();
    assert!(status.success(), "console --instance detaches with status 0, not {status}");
    samples
}

/// Opens a `console --node` tunnel's WebSocket as the bench's own client, and holds it.
async fn open_console(api: &Api, node: &str) -> impl Sized + use<> {
    let ticket = api.call("tunnels.open", json!({ "op": "console", "nodeId": node })).await;
    let ticket = ticket["ticket"].as_str().unwrap();
    let url = format!("{}/tunnels/{ticket}", api.url.replacen("http://", "ws://", 1));
    let mut request = url.into_client_request().unwrap();
    request.headers_mut().insert("authorization", HeaderValue::from_str(&format!("Bearer {}", api.token)).unwrap());
    request.headers_mut().insert("sec-websocket-protocol", HeaderValue::from_static(bc_core::tunnel::SUBPROTOCOL));
    let (socket, _) = tokio_tungstenite::connect_async(request).await.unwrap();
    let (sink, mut stream) = socket.split();
    // Read (and drop) what the shell prints, as a client would.
    let reader = tokio::spawn(async move { while let Some(Ok(_)) = stream.next().await {} });
    (sink, reader)
}

pub fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let bcd = bcd();
        let dir = tempfile::tempdir().unwrap();
        let (gateway, url, agents_port, serving_pin, log_pin) = start_gateway(&dir.path().join("gateway"));
        let token = std::fs::read_to_string(dir.path().join("gateway/admin.token")).unwrap().trim().to_owned();
        let api = Api { http: reqwest::Client::new(), url, token };
        let pool = api.call("pools.create", json!({ "name": "tunnels" })).await["poolId"].as_str().unwrap().to_owned();
        let seed = (1..100u64)
            .find(|seed| {
                let out = Command::new(&bcd).args(["hardware", "--fake-hw", &seed.to_string()]).output().unwrap();
                serde_json::from_slice::<Value>(&out.stdout).is_ok_and(|h| h["gpus"]["gpus"].as_array().is_some_and(|g| !g.is_empty()))
            })
            .expect("a fake machine with a GPU");
        let (transfers, console) = (transfer_server(), echo_console());
        let hardware = format!("[hardware]\nfake_seed = {seed}\nfake_guest_address = \"127.0.0.1\"\nfake_guest_console = \"{console}\"\n");
        let gateway_pins = (agents_port, serving_pin.as_str(), log_pin.as_str());
        let (guest_node, _) = start_node(&api, &bcd, &dir.path().join("guest-node"), gateway_pins, &hardware, &pool).await;
        let instance = running_instance(&api, &pool).await;

        let (raw, _) = best(&transfer(SocketAddr::from(([127, 0, 0, 1], transfers))));
        let (forward, local) = start_forward(&api, &instance, transfers);
        let pids = [gateway.0.id(), guest_node.0.id(), forward.0.id()];
        let cpu_before = pids.map(cpu_s);
        let started = Instant::now();
        let runs = tokio::task::spawn_blocking(move || transfer(local)).await.unwrap();
        let (tunnelled, cut) = best(&runs);
        let wall = started.elapsed().as_secs_f64();
        let cpu: Vec<f64> = pids.iter().zip(cpu_before).map(|(pid, before)| cpu_s(*pid) - before).collect();
        drop(forward);

        let samples = {
            let api = Api { http: api.http.clone(), url: api.url.clone(), token: api.token.clone() };
            let instance = instance.clone();
            tokio::task::spawn_blocking(move || keystrokes(&api, &instance)).await.unwrap()
        };

        let mut nodes = Vec::new();
        for n in 0..MEMORY_NODES {
            let hardware = format!("[hardware]\nfake_seed = {}\n", n + 1);
            nodes.push(start_node(&api, &bcd, &dir.path().join(format!("node-{n}")), gateway_pins, &hardware, &pool).await);
        }
        tokio::time::sleep(Duration::from_millis(SETTLE_MS)).await;
        let before = rss_kib(gateway.0.id());
        let mut open = Vec::new();
        for (_, node) in &nodes {
            for _ in 0..TUNNELS_PER_NODE {
                open.push(open_console(&api, node).await);
            }
        }
        tokio::time::sleep(Duration::from_millis(SETTLE_MS)).await;
        let after = rss_kib(gateway.0.id());
        let tunnels = open.len();
        drop(open);

        let ratio = |(up, down): (f64, f64)| (tunnelled.0 / up, tunnelled.1 / down);
        let (up_ratio, down_ratio) = ratio(raw);
        println!();
        println!(
            "tunnels (release dev and bcd on loopback, agents' endpoint over TLS, {} cores)",
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
        );
        println!("  forward up   (local → guest), {} MiB     {:>8.0} MiB/s, raw TCP {:>6.0} MiB/s, ratio {up_ratio:.2} (goal ≥ 0.5)", FORWARD_BYTES >> 20, tunnelled.0, raw.0);
        println!("  forward down (guest → local), {} MiB     {:>8.0} MiB/s, raw TCP {:>6.0} MiB/s, ratio {down_ratio:.2} (goal ≥ 0.5)", FORWARD_BYTES >> 20, tunnelled.1, raw.1);
        println!(
            "  forward runs, MiB/s                       up {}; down {}",
            listed(runs.iter().map(|r| Some(r.0))),
            listed(runs.iter().map(|r| r.1))
        );
        println!(
            "  CPU over the forward transfers ({wall:.1} s)  gateway {:.1} s, bcd {:.1} s, forward {:.1} s ({} GiB up, {} GiB down)",
            cpu[0],
            cpu[1],
            cpu[2],
            (TRANSFER_RUNS * FORWARD_BYTES) >> 30,
            ((TRANSFER_RUNS - cut) * FORWARD_BYTES) >> 30
        );
        println!(
            "  console keystroke round trip p50 / p99    {:>8.2} / {:.2} ms ({KEYSTROKES} keystrokes; goal p99 < 5)",
            percentile(&samples, 0.5),
            percentile(&samples, 0.99)
        );
        println!(
            "  gateway memory per open tunnel            {:>8.1} KiB ({tunnels} idle consoles on {MEMORY_NODES} nodes; RSS {:.1} → {:.1} MiB)",
            (after - before) / tunnels as f64,
            before / 1024.0,
            after / 1024.0
        );
    });
}
