//! Instance tunnels end to end (`schema/TUNNELS.md`): `dev`, a fakehw `bcd node` whose fake
//! hypervisor's guests are this machine's loopback (`[hardware] fake_guest_address`) and whose
//! serial console is a TCP server the test runs (`fake_guest_console`), and an instance running
//! there. The test's servers are the guest:
//!
//! - `better-compute forward` to an echo server: 1 GiB up and 1 GiB down arrive intact (SHA-256
//!   of what was sent and of what came back), one after the other and then both at once on one
//!   connection, twenty local connections at once (the node carries
//!   16 tunnels by default: the four others are closed with a note), and a local reader that
//!   stalls, or a guest that reads nothing, leaves the CLI's memory bounded (its peak RSS, from
//!   `/proc`) and holds the other side back, and a stalled reader that reads again gets the rest;
//! - `console --instance` on the guest's serial console, through a pseudo-terminal, and again
//!   over `wss://` through a TLS front the CLI trusts as it trusts any server (the platform's
//!   roots, `SSL_CERT_FILE` here); `exec --instance` refused with the reason.

use std::io::{BufRead, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bc_tests::{AgentNode, ImageServer, Server, wait_until};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// Tunnels one node carries at once by default (`dev --tunnels-per-node-max`): each is a stream
/// of its agent's HTTP/2 connection, which carries 32 with the session.
const NODE_TUNNELS_MAX: usize = bc_gateway::tunnels::TUNNELS_PER_NODE_MAX;
/// Local connections opened at once: more than the node carries.
const CONNECTIONS_AT_ONCE: usize = NODE_TUNNELS_MAX + 4;
/// The bytes sent each way through one forwarded connection.
const TRANSFER_BYTES: usize = 1 << 30;
/// The bytes echoed through one connection, both ways at once: as much as each way alone.
const ECHO_BYTES: usize = TRANSFER_BYTES;
/// What the CLI's resident memory may grow by while a local reader stalls: the 4 MiB it holds
/// for the reader before it stops reading the tunnel, and the allocator's slack (measured with
/// the 16 MiB the CLI once held before it cut such a reader off: 20 MiB).
const BEHIND_RSS_MAX_BYTES: u64 = 32 << 20;
/// ...and while the guest reads nothing: the 4 MiB unsent before the local socket pauses, and
/// the slack (measured: 14 MiB; without the pause it holds what the writer sent, up to 1 GiB).
const UNSENT_RSS_MAX_BYTES: u64 = 24 << 20;

async fn call_ok(server: &Server, method: &str, body: Value) -> Value {
    let (status, doc) = server.call(method, body).await;
    assert_eq!(status, 200, "{method}: {doc}");
    doc
}

async fn tunnel_events(server: &Server) -> Vec<Value> {
    call_ok(server, "events.list", json!({ "types": ["tunnel.*"], "limit": 100 })).await["items"].as_array().unwrap().clone()
}

/// A dev server, a fake machine whose guests are on loopback (its console at `console`), and a
/// running instance on it.
struct World {
    server: Server,
    machine: AgentNode,
    node: String,
    instance: String,
    _images: ImageServer,
}

async fn world(console: std::net::SocketAddr) -> World {
    let (server, port) = bc_tests::agents_gateway_with(&["--tunnels-per-node-max", &NODE_TUNNELS_MAX.to_string()]);
    let seed = (1..100u64)
        .find(|seed| bc_tests::fake_hardware(*seed)["gpus"]["gpus"].as_array().is_some_and(|g| !g.is_empty()))
        .expect("a fake machine with a GPU among seeds 1..100");
    let pool = server.pool("vms").await;
    let mut machine = AgentNode::new(&server, port);
    let config = std::fs::read_to_string(machine.config()).unwrap();
    let hardware =
        format!("[hardware]\nfake_seed = {seed}\nfake_guest_address = \"127.0.0.1\"\nfake_guest_console = \"{console}\"\n");
    std::fs::write(machine.config(), format!("{config}\n{hardware}")).unwrap();
    machine.join_pool(&server, &pool).await;
    let node = machine.node_id();
    machine.start();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let doc = call_ok(&server, "nodes.get", json!({ "nodeId": node })).await;
        let caps = doc["agent"]["inventory"]["capabilities"].as_array().cloned().unwrap_or_default();
        // (`tunnel.instance-dial` is said in the session's Hello, which nodes.get does not show.)
        if doc["state"] == "ready" && caps.iter().any(|c| c == "instance.apply") {
            break;
        }
        assert!(Instant::now() < deadline, "node not ready with instance.apply: {doc}\n{}", machine.node_log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let bytes = bc_tests::qcow2_image(256 * 1024);
    let digest = hex::encode(Sha256::digest(&bytes));
    let images = ImageServer::start("guest.qcow2", bytes);
    let image = call_ok(
        &server,
        "images.register",
        json!({ "name": "guest", "url": images.url, "sha256": digest, "diskFormat": "qcow2" }),
    )
    .await;
    let flavor = call_ok(
        &server,
        "flavors.create",
        json!({ "poolId": pool, "name": "small", "vcpus": 1, "memoryMiB": 512, "diskGiB": 1, "gpus": 1 }),
    )
    .await;
    let rsv = call_ok(&server, "reservations.create", json!({ "poolId": pool, "gpus": 1, "durationS": 3600 })).await;
    let rsv = rsv["reservationId"].as_str().unwrap().to_owned();
    wait_until("the reservation's GPU is held", Duration::from_secs(30), || {
        let doc = bc_tests::block_on(server.call("reservations.get", json!({ "reservationId": rsv }))).1;
        (doc["binding"]["state"] == "bound").then_some(())
    });
    let created = call_ok(
        &server,
        "instances.create",
        json!({ "name": "guest", "reservationId": rsv, "flavorId": flavor["flavorId"], "imageId": image["imageId"] }),
    )
    .await;
    let instance = created["instanceId"].as_str().unwrap().to_owned();
    wait_until("the instance runs", Duration::from_secs(60), || {
        let doc = bc_tests::block_on(server.call("instances.get", json!({ "instanceId": instance }))).1;
        (doc["state"] == "running").then_some(())
    });
    World { server, machine, node, instance, _images: images }
}

/// The guest's echo server: every connection gets back what it sends, until it closes.
fn echo_server() -> u16 {
    serve(|mut socket| {
        let mut back = socket.try_clone().unwrap();
        let _ = std::io::copy(&mut socket, &mut back);
    })
}

/// The guest's transfer server: a connection's first byte asks `U` (it reads `TRANSFER_BYTES`
/// and answers their SHA-256) or `D` (it sends `TRANSFER_BYTES` of [`Noise`] and closes); the
/// SHA-256 of what it sent or received is also kept in `digests`.
fn transfer_server(digests: Arc<Mutex<Vec<[u8; 32]>>>) -> u16 {
    serve(move |mut socket| {
        let mut ask = [0u8; 1];
        socket.read_exact(&mut ask).unwrap();
        let mut hash = Sha256::new();
        if ask[0] == b'U' {
            let (mut buffer, mut left) = (vec![0u8; 1 << 20], TRANSFER_BYTES);
            while left > 0 {
                let n = socket.read(&mut buffer[..left.min(1 << 20)]).unwrap();
                assert!(n > 0, "the upload ended {left} bytes early");
                hash.update(&buffer[..n]);
                left -= n;
            }
            let digest: [u8; 32] = hash.finalize().into();
            digests.lock().unwrap().push(digest);
            socket.write_all(&digest).unwrap();
        } else {
            let (noise, mut block) = (Noise::new(), Vec::new());
            for index in 0..TRANSFER_BYTES >> 20 {
                noise.block(index, &mut block);
                hash.update(&block);
                socket.write_all(&block).unwrap();
            }
            digests.lock().unwrap().push(hash.finalize().into());
        }
    })
}

/// A guest server that runs `each` on a thread per connection; its port.
fn serve(each: impl Fn(TcpStream) + Send + Sync + 'static) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let each = Arc::new(each);
    std::thread::spawn(move || {
        for socket in listener.incoming().flatten() {
            let each = each.clone();
            std::thread::spawn(move || each(socket));
        }
    });
    port
}

/// `better-compute forward` running, its stderr read line by line.
struct Forward {
    child: Child,
    local: std::net::SocketAddr,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl Forward {
    fn start(server: &Server, instance: &str, port: u16) -> Forward {
        let mut child = Command::new(bc_tests::binary("better-compute"))
            .args(["forward", "--instance", instance, "--port", &port.to_string(), "--local-port", "0"])
            .envs(server.env())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let lines = stderr.clone();
        let reader = std::io::BufReader::new(child.stderr.take().unwrap());
        std::thread::spawn(move || {
            for line in reader.lines().map_while(Result::ok) {
                lines.lock().unwrap().push(line);
            }
        });
        let local = wait_until("forward listens", Duration::from_secs(20), || {
            let lines = stderr.lock().unwrap();
            let line = lines.iter().find(|l| l.starts_with("forwarding "))?;
            line.split_whitespace().nth(1)?.parse().ok()
        });
        Forward { child, local, stderr }
    }

    fn connect(&self) -> TcpStream {
        TcpStream::connect(self.local).unwrap()
    }

    fn notes(&self) -> Vec<String> {
        self.stderr.lock().unwrap().iter().filter(|l| l.starts_with("forward: connection")).cloned().collect()
    }

    /// The process's resident memory now and at its peak, in bytes (`VmRSS`, `VmHWM`).
    fn memory(&self) -> (u64, u64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
                .unwrap()
                * 1024
        };
        (field("VmRSS:"), field("VmHWM:"))
    }

    /// Carries one connection (`use_it` uses it) and closes it, so what any connection
    /// allocates once (the HTTP clients, the system's roots) is there; the resident memory then.
    fn warmed_up(&self, use_it: impl FnOnce(&mut TcpStream)) -> u64 {
        let mut socket = self.connect();
        socket.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        use_it(&mut socket);
        drop(socket);
        std::thread::sleep(Duration::from_millis(500));
        self.memory().0
    }

    /// SIGINT (Ctrl-C): it stops, exit 0.
    fn interrupt(mut self) {
        let _ = Command::new("kill").args(["-INT", &self.child.id().to_string()]).status();
        let status = wait_until("forward stops on Ctrl-C", Duration::from_secs(10), || self.child.try_wait().unwrap());
        assert_eq!(status.code(), Some(0), "{:?}", self.stderr.lock().unwrap());
    }
}

impl Drop for Forward {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// 1 MiB blocks of noise, each 4 KiB of them starting with its own index, so no two parts of
/// the stream are alike: a byte lost, doubled or moved changes its digest.
struct Noise {
    base: Vec<u8>,
}

impl Noise {
    fn new() -> Noise {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let base = (0..1 << 20)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect();
        Noise { base }
    }

    fn block(&self, index: usize, into: &mut Vec<u8>) {
        into.clear();
        into.extend_from_slice(&self.base);
        for (n, page) in into.chunks_mut(4096).enumerate() {
            page[..8].copy_from_slice(&((index * 256 + n) as u64).to_le_bytes());
        }
    }
}

/// Sends `TRANSFER_BYTES` of [`Noise`] through `socket` to the transfer server: the SHA-256 of
/// what was sent, the one the server answered, and how long it took.
fn upload(mut socket: TcpStream) -> ([u8; 32], [u8; 32], Duration) {
    let started = Instant::now();
    socket.write_all(b"U").unwrap();
    let (noise, mut block, mut hash) = (Noise::new(), Vec::new(), Sha256::new());
    for index in 0..TRANSFER_BYTES >> 20 {
        noise.block(index, &mut block);
        hash.update(&block);
        socket.write_all(&block).unwrap();
    }
    socket.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut answered = [0u8; 32];
    socket.read_exact(&mut answered).unwrap();
    (hash.finalize().into(), answered, started.elapsed())
}

/// Sends `bytes` of [`Noise`] through `socket` while reading back as many (an echo): the SHA-256
/// of what was sent and of what came back, or how it ended early.
fn echo_through(socket: TcpStream, bytes: usize) -> Result<([u8; 32], [u8; 32]), String> {
    let mut writer = socket.try_clone().unwrap();
    let sending = std::thread::spawn(move || {
        let (noise, mut block, mut hash) = (Noise::new(), Vec::new(), Sha256::new());
        for index in 0..bytes >> 20 {
            noise.block(index, &mut block);
            hash.update(&block);
            writer.write_all(&block).map_err(|e| format!("sending failed after {index} MiB: {e}"))?;
        }
        Ok::<_, String>(<[u8; 32]>::from(hash.finalize()))
    });
    let mut reader = socket;
    reader.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let (mut hash, mut buffer, mut left) = (Sha256::new(), vec![0u8; 1 << 20], bytes);
    while left > 0 {
        let n = reader.read(&mut buffer[..left.min(1 << 20)]).map_err(|e| format!("reading failed {left} bytes early: {e}"))?;
        if n == 0 {
            return Err(format!("the echo ended {left} bytes early"));
        }
        hash.update(&buffer[..n]);
        left -= n;
    }
    Ok((sending.join().unwrap()?, hash.finalize().into()))
}

/// The last `lines` lines of a log, for a failure's message.
fn tail(log: &str, lines: usize) -> String {
    let all: Vec<&str> = log.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Asks the transfer server for `TRANSFER_BYTES` through `socket` and reads them to the end:
/// their SHA-256, and how long it took.
fn download(mut socket: TcpStream) -> ([u8; 32], Duration) {
    let started = Instant::now();
    socket.write_all(b"D").unwrap();
    socket.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let (mut hash, mut buffer, mut total) = (Sha256::new(), vec![0u8; 1 << 20], 0usize);
    loop {
        let n = socket.read(&mut buffer).unwrap();
        if n == 0 {
            break;
        }
        hash.update(&buffer[..n]);
        total += n;
    }
    assert_eq!(total, TRANSFER_BYTES, "the whole download, then the end");
    (hash.finalize().into(), started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forward_carries_a_gibibyte_ten_connections_and_keeps_its_memory_bounded() {
    bc_tests::raise_open_file_limit(4096);
    let unused = TcpListener::bind("127.0.0.1:0").unwrap();
    let world = world(unused.local_addr().unwrap()).await;
    let digests = Arc::new(Mutex::new(Vec::new()));
    let transfers = transfer_server(digests.clone());
    let forward = Forward::start(&world.server, &world.instance, transfers);

    // 1 GiB up, then 1 GiB down, intact.
    let (sent, answered, took) = upload(forward.connect());
    eprintln!("forward: 1 GiB up in {:.1} s ({:.0} MiB/s)", took.as_secs_f64(), 1024.0 / took.as_secs_f64());
    assert_eq!(hex::encode(answered), hex::encode(sent), "the guest received what was sent");
    let (received, took) = download(forward.connect());
    eprintln!("forward: 1 GiB down in {:.1} s ({:.0} MiB/s)", took.as_secs_f64(), 1024.0 / took.as_secs_f64());
    assert_eq!(hex::encode(received), hex::encode(digests.lock().unwrap()[1]), "the client received what the guest sent");

    // Their tunnels ended with them (the node's slots are free again), with the bytes each way.
    let closed = wait_until("two tunnel.closed", Duration::from_secs(20), || {
        let events = bc_tests::block_on(tunnel_events(&world.server));
        let closed: Vec<Value> = events.into_iter().filter(|e| e["type"] == "tunnel.closed").collect();
        (closed.len() == 2).then_some(closed)
    });
    let counts: Vec<(u64, u64)> =
        closed.iter().map(|c| (c["payload"]["bytesIn"].as_u64().unwrap(), c["payload"]["bytesOut"].as_u64().unwrap())).collect();
    let transfer = TRANSFER_BYTES as u64;
    assert!(counts.contains(&(transfer + 1, 32)) && counts.contains(&(1, transfer)), "{closed:?}");
    forward.interrupt();
    let echo = echo_server();
    let forward = Forward::start(&world.server, &world.instance, echo);

    // Both ways at once on one connection (each side's directions are separate tasks): what
    // comes back from the guest's echo is what was sent, 1 GiB each way.
    let started = Instant::now();
    let (sent, echoed) = match echo_through(forward.connect(), ECHO_BYTES) {
        Ok(digests) => digests,
        Err(ended) => {
            std::thread::sleep(Duration::from_secs(1));
            let closed: Vec<Value> =
                bc_tests::block_on(tunnel_events(&world.server)).into_iter().filter(|e| e["type"] == "tunnel.closed").collect();
            panic!(
                "{ended}\nforward's notes: {:?}\ntunnel.closed: {closed:?}\nthe gateway's log, its end:\n{}\nthe node's log, its end:\n{}",
                forward.stderr.lock().unwrap(),
                tail(&world.server.log_text(), 40),
                tail(&world.machine.node_log(), 40)
            )
        }
    };
    let took = started.elapsed();
    eprintln!(
        "forward: 1 GiB each way at once in {:.1} s ({:.0} MiB/s each way)",
        took.as_secs_f64(),
        1024.0 / took.as_secs_f64()
    );
    assert_eq!(hex::encode(echoed), hex::encode(sent), "{ECHO_BYTES} bytes echoed at once");
    wait_until("the echo's tunnel.closed", Duration::from_secs(20), || {
        let events = bc_tests::block_on(tunnel_events(&world.server));
        (events.iter().filter(|e| e["type"] == "tunnel.closed").count() == 3).then_some(())
    });

    // More than ten at once: the node carries NODE_TUNNELS_MAX, the others are closed with a note.
    const _: () = assert!(NODE_TUNNELS_MAX >= 10);
    let sockets: Vec<TcpStream> = (0..CONNECTIONS_AT_ONCE).map(|_| forward.connect()).collect();
    let answered: Vec<bool> = sockets
        .iter()
        .enumerate()
        .map(|(i, socket)| {
            let mut socket = socket.try_clone().unwrap();
            socket.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            let hello = format!("hello from {i}");
            let _ = socket.write_all(hello.as_bytes());
            let mut back = vec![0u8; hello.len()];
            socket.read_exact(&mut back).is_ok_and(|()| back == hello.as_bytes())
        })
        .collect();
    assert_eq!(answered.iter().filter(|a| **a).count(), NODE_TUNNELS_MAX, "{answered:?} {:?}", forward.notes());
    let notes = wait_until("a note for each connection not carried", Duration::from_secs(10), || {
        let notes = forward.notes();
        (notes.len() == CONNECTIONS_AT_ONCE - NODE_TUNNELS_MAX).then_some(notes)
    });
    assert!(notes.iter().all(|n| n.contains("QUOTA_EXCEEDED") && n.contains("open tunnels")), "{notes:?}");
    drop(sockets);
    // Their tunnels end with them: a new connection is carried again.
    wait_until("a connection is carried again", Duration::from_secs(20), || {
        let mut socket = forward.connect();
        socket.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        socket.write_all(b"again").ok()?;
        let mut back = [0u8; 5];
        socket.read_exact(&mut back).ok().filter(|()| &back == b"again")
    });
    forward.interrupt();

    stalled_reader_and_guest(&world).await;
    drop(world.machine);
}

/// A local reader that reads nothing, then a guest that reads nothing: the CLI's peak memory
/// stays bounded (the tunnel's marks, 4 MiB behind and 4 MiB unsent, plus buffers) and the other
/// side is held back (the guest's writes stop; the local writer's do); the stalled reader that
/// reads again gets the rest, its connection never cut.
async fn stalled_reader_and_guest(world: &World) {
    let written = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let flood = serve({
        let written = written.clone();
        move |mut socket| {
            let block = vec![0x5au8; 64 * 1024];
            while socket.write_all(&block).is_ok() {
                written.fetch_add(block.len() as u64, std::sync::atomic::Ordering::Relaxed);
            }
        }
    });
    let forward = Forward::start(&world.server, &world.instance, flood);
    let baseline = forward.warmed_up(|socket| socket.read_exact(&mut [0u8; 1]).unwrap());
    let mut stalled = forward.connect();
    // Held back all the way: the guest's writes stop for two seconds while nothing is read.
    let mut last = (u64::MAX, Instant::now());
    let held_at = wait_until("the guest is held back by the stalled reader", Duration::from_secs(120), || {
        let now = written.load(std::sync::atomic::Ordering::Relaxed);
        if now != last.0 {
            last = (now, Instant::now());
            return None;
        }
        (last.1.elapsed() > Duration::from_secs(2)).then_some(now)
    });
    let (_, peak) = forward.memory();
    eprintln!(
        "forward: stalled reader: the guest held back after {} MiB; baseline {} MiB, peak {} MiB",
        held_at >> 20,
        baseline >> 20,
        peak >> 20
    );
    assert!(
        peak < baseline + BEHIND_RSS_MAX_BYTES,
        "the CLI's memory is bounded: {} MiB over {} MiB",
        (peak - baseline) >> 20,
        baseline >> 20
    );
    assert!(forward.notes().is_empty(), "the stalled reader is never cut off: {:?}", forward.notes());
    // The stalled tunnel holds back its own stream only: another connection, a stream of the
    // same agent connection, is carried at once. (With hyper's default windows the stalled
    // stream's unread megabyte was the gateway's whole connection window: this read waited, and
    // so did the node's session, until the stalled reader read again.)
    let mut other = forward.connect();
    other.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let started = Instant::now();
    let mut buffer = vec![0u8; 1 << 20];
    other.read_exact(&mut buffer).unwrap_or_else(|e| {
        panic!("a second connection beside the stalled one got no megabyte within 10 s: {e}; {:?}", forward.notes())
    });
    eprintln!("forward: beside the stalled reader, a second connection's first MiB in {:?}", started.elapsed());
    drop(other);
    // It reads again: 64 MiB more than the guest had written when it was held back.
    stalled.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let wanted = held_at + (64 << 20);
    let mut drained = 0u64;
    while drained < wanted {
        match stalled.read(&mut buffer) {
            Ok(n @ 1..) => drained += n as u64,
            other => panic!("the stalled reader's connection ended after {drained} bytes: {other:?}; {:?}", forward.notes()),
        }
    }
    drop(stalled);
    forward.interrupt();

    let sink = serve(|socket| {
        // Reads nothing, holds the connection.
        std::thread::sleep(Duration::from_secs(60));
        drop(socket);
    });
    let forward = Forward::start(&world.server, &world.instance, sink);
    let baseline = forward.warmed_up(|socket| socket.write_all(b"x").unwrap());
    let mut writer = forward.connect();
    writer.set_write_timeout(Some(Duration::from_secs(3))).unwrap();
    let block = vec![0xa5u8; 1 << 20];
    let mut written = 0usize;
    while written < 1 << 30 && writer.write_all(&block).is_ok() {
        written += block.len();
    }
    let (_, peak) = forward.memory();
    eprintln!(
        "forward: stalled guest: {} MiB written before the writer was held; peak {} MiB over {} MiB",
        written >> 20,
        (peak - baseline) >> 20,
        baseline >> 20
    );
    assert!(written < 256 << 20, "the local writer is held back: {} MiB written", written >> 20);
    assert!(
        peak < baseline + UNSENT_RSS_MAX_BYTES,
        "the CLI's memory is bounded: {} MiB over {} MiB",
        (peak - baseline) >> 20,
        baseline >> 20
    );
    forward.interrupt();
}

/// The guest's serial console: a TCP server (as QEMU's `-serial tcp:` chardev is a client of
/// one) that answers each chunk it is sent with `guest got: CHUNK`; its address.
fn serial_console() -> (TcpListener, std::net::SocketAddr) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    (listener, address)
}

fn answer_on(listener: TcpListener) {
    std::thread::spawn(move || {
        for socket in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut socket = socket;
                let _ = socket.write_all(b"guest login: ");
                let mut buffer = [0u8; 4096];
                while let Ok(n @ 1..) = socket.read(&mut buffer) {
                    let typed = String::from_utf8_lossy(&buffer[..n]).trim().to_owned();
                    if socket.write_all(format!("guest got: {typed}\r\n").as_bytes()).is_err() {
                        return;
                    }
                }
            });
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_reaches_an_instances_serial_console_over_ws_and_wss_and_exec_is_refused() {
    let (listener, console) = serial_console();
    answer_on(listener);
    let world = world(console).await;

    // The test is the user: `console --instance` on a pseudo-terminal; Ctrl-] detaches, exit 0.
    let pty = portable_pty::native_pty_system();
    let pair = pty.openpty(portable_pty::PtySize { rows: 30, cols: 100, pixel_width: 0, pixel_height: 0 }).unwrap();
    let mut command = portable_pty::CommandBuilder::new(bc_tests::binary("better-compute"));
    command.args(["console", "--instance", &world.instance]);
    for (key, value) in world.server.env() {
        command.env(key, value);
    }
    let mut cli = pair.slave.spawn_command(command).unwrap();
    drop(pair.slave);
    let seen = bc_tests::capture(pair.master.try_clone_reader().unwrap());
    let mut keyboard = pair.master.take_writer().unwrap();
    bc_tests::wait_for(&seen, "guest login: ");
    keyboard.write_all(b"root\r").unwrap();
    bc_tests::wait_for(&seen, "guest got: root");
    keyboard.write_all(&[0x1d]).unwrap();
    let status = wait_until("the console detaches", Duration::from_secs(20), || cli.try_wait().unwrap());
    assert_eq!(status.exit_code(), 0, "{}", String::from_utf8_lossy(&seen.lock().unwrap()));
    let opened = wait_until("tunnel.opened", Duration::from_secs(10), || {
        bc_tests::block_on(tunnel_events(&world.server)).into_iter().find(|e| e["type"] == "tunnel.opened")
    });
    assert_eq!(opened["stream"], format!("node/{}", world.node));
    assert_eq!(
        (opened["payload"]["op"].as_str(), opened["payload"]["instanceId"].as_str()),
        (Some("console"), Some(world.instance.as_str()))
    );

    // The same over wss://, through a TLS front whose CA the CLI trusts as a platform root.
    let pki = bc_tests::sushy::pki();
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &pki.ca_pem).unwrap();
    let front = tls_front(&pki, world.server.url.trim_start_matches("http://")).await;
    let mut cli = Command::new(bc_tests::binary("better-compute"))
        .args(["console", "--instance", &world.instance])
        .env("BETTER_COMPUTE_URL", format!("https://localhost:{front}"))
        .env("BETTER_COMPUTE_TOKEN", &world.server.token)
        .env("SSL_CERT_FILE", &ca)
        .env_remove("SSL_CERT_DIR")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let seen = bc_tests::capture(Box::new(cli.stdout.take().unwrap()));
    let errors = bc_tests::capture(Box::new(cli.stderr.take().unwrap()));
    let mut keyboard = cli.stdin.take().unwrap();
    bc_tests::wait_for(&seen, "guest login: ");
    keyboard.write_all(b"over tls\r").unwrap();
    bc_tests::wait_for(&seen, "guest got: over tls");
    keyboard.write_all(&[0x1d]).unwrap();
    let status = wait_until("the console over wss detaches", Duration::from_secs(20), || cli.try_wait().unwrap());
    assert_eq!(status.code(), Some(0), "{}", String::from_utf8_lossy(&errors.lock().unwrap()));
    // Without that CA, the same server is not trusted: nothing is opened.
    let (code, _, err) = bc_tests::cli(
        &["console", "--instance", &world.instance],
        &[("BETTER_COMPUTE_URL", &format!("https://localhost:{front}")), ("BETTER_COMPUTE_TOKEN", &world.server.token)],
    );
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("UnknownIssuer") && err.contains("UNAVAILABLE: cannot reach https://localhost"), "{err}");

    // exec is refused before any ticket, with the reason and what works instead.
    let (code, out, err) = world.server.cli(&["exec", "--instance", &world.instance]);
    assert_eq!(code, 1, "{out} {err}");
    assert!(err.contains("UNSUPPORTED: ") && err.contains("until guests have an agent"), "{err}");
    assert!(err.contains("hint: `better-compute console --instance"), "{err}");
    // The new commands are in the manifest and the completion.
    let (code, manifest, _) = bc_tests::cli(&["help", "--json"], &[]);
    assert_eq!(code, 0);
    let manifest = bc_tests::json(&manifest);
    for name in ["console", "exec", "forward"] {
        assert!(manifest["commands"].as_array().unwrap().iter().any(|c| c["name"] == name), "{name} in help --json");
    }
    let (_, completion, _) = bc_tests::cli(&["completion", "bash"], &[]);
    assert!(completion.contains("--local-port") && completion.contains("forward"), "forward is completed");
    drop(world.machine);
}

/// A TLS front for `upstream` (the dev server's `HOST:PORT`) on a loopback port, serving the
/// test PKI's `localhost` certificate: what a deployment's reverse proxy is.
async fn tls_front(pki: &bc_tests::sushy::Pki, upstream: &str) -> u16 {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain = vec![CertificateDer::from_pem_slice(pki.server_pem.as_bytes()).unwrap()];
    let key = PrivateKeyDer::from_pem_slice(pki.server_key_pem.as_bytes()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let upstream = upstream.to_owned();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, upstream) = (acceptor.clone(), upstream.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else { return };
                let Ok(mut plain) = tokio::net::TcpStream::connect(&upstream).await else { return };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
            });
        }
    });
    port
}
