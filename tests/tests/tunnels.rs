//! Tunnels end to end (`schema/TUNNELS.md`): `dev` and a fakehw `bcd node`; `better-compute
//! console --node` driven through a pseudo-terminal by the test as its user; tickets refused
//! (spent, expired, another tenant's key); a client the project did not write (Python's
//! `websockets`, `tests/scripts/tunnel_client.py`) running a command on the node's console and
//! reading its status; and the tunnel ended under it: its key revoked, its maximum duration,
//! its idle timeout, its agent killed. Each ending is seen by the client and in the log.

use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bc_tests::{AgentNode, Server, wait_until};
use serde_json::{Value, json};

/// A joined, running node of `server`.
async fn running_node(server: &Server, port: u16) -> (AgentNode, String) {
    let pool = server.pool("gpu-a").await;
    let (status, token) = server.call("joinTokens.create", json!({ "poolId": pool })).await;
    assert_eq!(status, 200, "{token}");
    let mut machine = AgentNode::new(server, port);
    let (code, out, err) = machine.join_stdin(token["token"].as_str().unwrap());
    assert_eq!(code, 0, "bcd join: {out} {err}");
    machine.start();
    let node = machine.node_id();
    wait_until("the node's session is live", Duration::from_secs(20), || machine.status().filter(|s| s["session"] == "live"));
    (machine, node)
}

async fn tunnel_events(server: &Server) -> Vec<Value> {
    let (status, page) = server.call("events.list", json!({ "types": ["tunnel.*"], "limit": 100 })).await;
    assert_eq!(status, 200, "{page}");
    page["items"].as_array().unwrap().clone()
}

/// A WebSocket upgrade of `/tunnels/{ticket}` as `token`, read as an HTTP answer (refusals come
/// before the upgrade).
async fn upgrade_status(server: &Server, ticket: &str, token: &str) -> (u16, Value) {
    let response = reqwest::Client::new()
        .get(format!("{}/tunnels/{ticket}", server.url))
        .header("connection", "Upgrade")
        .header("upgrade", "websocket")
        .header("sec-websocket-version", "13")
        .header("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==")
        .header("sec-websocket-protocol", "v5.channel.k8s.io")
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_on_a_node_through_a_pseudo_terminal_returns_the_remote_status_and_is_accounted() {
    let (server, port) = bc_tests::agents_gateway();
    let (_machine, node) = running_node(&server, port).await;

    // The test is the user: the CLI on a terminal of 100 × 30.
    let pty = portable_pty::native_pty_system();
    let pair = pty.openpty(portable_pty::PtySize { rows: 30, cols: 100, pixel_width: 0, pixel_height: 0 }).unwrap();
    let mut command = portable_pty::CommandBuilder::new(bc_tests::binary("better-compute"));
    command.args(["console", "--node", &node]);
    for (key, value) in server.env() {
        command.env(key, value);
    }
    let mut cli = pair.slave.spawn_command(command).unwrap();
    drop(pair.slave);
    let seen = bc_tests::capture(pair.master.try_clone_reader().unwrap());
    let mut keyboard = pair.master.take_writer().unwrap();
    keyboard.write_all(b"tty; stty size\r").unwrap();
    bc_tests::wait_for(&seen, "/dev/pts/");
    bc_tests::wait_for(&seen, "30 100");
    // A resize of the local terminal reaches the remote one.
    pair.master.resize(portable_pty::PtySize { rows: 40, cols: 120, pixel_width: 0, pixel_height: 0 }).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    keyboard.write_all(b"stty size; exit 7\r").unwrap();
    bc_tests::wait_for(&seen, "40 120");
    let status = wait_until("the console exits", Duration::from_secs(20), || cli.try_wait().unwrap());
    assert_eq!(status.exit_code(), 7, "{}", String::from_utf8_lossy(&seen.lock().unwrap()));

    let events = console_events_say(&server, &node, 7, "tty; stty size\r".len() + "stty size; exit 7\r".len());
    let closed = &events[1];
    assert!(closed["payload"]["bytesOut"].as_u64().unwrap() > 20, "{closed}");
    assert!(!events.iter().any(|e| e.to_string().contains("stty")), "nothing typed is logged: {events:?}");
}

/// Tickets used wrongly are refused with the API's envelope and a stable `details.reason`, and
/// recorded as `tunnel.refused` on the node's stream (who presented it, from where, why; never the
/// ticket): another tenant's key, a spent ticket, an expired one (`--tunnel-ticket-ttl 1s`). One
/// never issued names no node: it is answered only. No ticket is in the server's log, even at
/// `debug`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spent_an_expired_and_another_keys_ticket_are_refused_by_name_and_recorded() {
    let mut port = 0;
    let server = Server::with_log_filter("debug", || {
        let (server, agents_port) = bc_tests::agents_gateway_with(&["--tunnel-ticket-ttl", "1s"]);
        port = agents_port;
        server
    });
    let (_machine, node) = running_node(&server, port).await;
    let open = || async {
        let (status, ticket) = server.call("tunnels.open", json!({ "op": "console", "nodeId": node })).await;
        assert_eq!(status, 200, "{ticket}");
        ticket["ticket"].as_str().unwrap().to_owned()
    };
    let admin_key = server.token.split('.').next().unwrap().to_owned();

    // Another tenant's key, which may open consoles in its own tenant, cannot use it.
    let (status, tenant) = server.call("tenants.create", json!({ "name": "acme" })).await;
    assert_eq!(status, 200, "{tenant}");
    let (status, key) = server
        .call("apiKeys.create", json!({ "tenantId": tenant["tenantId"], "name": "ops", "actions": ["compute:nodes:console"] }))
        .await;
    assert_eq!(status, 200, "{key}");
    let (other, other_key) = (key["token"].as_str().unwrap(), key["keyId"].as_str().unwrap());
    let ticket = open().await;
    let (status, refused) = upgrade_status(&server, &ticket, other).await;
    assert_eq!(
        (status, refused["code"].as_str(), refused["details"]["reason"].as_str()),
        (403, Some("ACCESS_DENIED"), Some("other-key"))
    );
    assert!(refused["message"].as_str().unwrap().contains("another API key"), "{refused}");
    let (status, refused) = server.call_as(other, "tunnels.open", json!({ "op": "console", "nodeId": node }), None).await;
    assert_eq!((status, refused["code"].as_str()), (404, Some("NOT_FOUND")), "not acme's node: {refused}");

    // Spent: the owner uses it once (the upgrade answers 101), and not again.
    let (status, _) = upgrade_status(&server, &ticket, &server.token).await;
    assert_eq!(status, 101);
    let (status, refused) = upgrade_status(&server, &ticket, &server.token).await;
    assert_eq!(
        (status, refused["code"].as_str(), refused["details"]["reason"].as_str()),
        (409, Some("INVALID_STATE"), Some("spent"))
    );
    assert!(refused["message"].as_str().unwrap().contains("spent"), "{refused}");

    // Expired: a second after its issue.
    let late = open().await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let (status, refused) = upgrade_status(&server, &late, &server.token).await;
    assert_eq!(
        (status, refused["code"].as_str(), refused["details"]["reason"].as_str()),
        (409, Some("INVALID_STATE"), Some("expired"))
    );
    assert!(refused["message"].as_str().unwrap().contains("expired: a ticket is good for 1 s"), "{refused}");

    // A ticket that was never issued: answered, and no node to record it on.
    let (status, refused) = upgrade_status(&server, &format!("bctt_{}", "A".repeat(43)), &server.token).await;
    assert_eq!(
        (status, refused["code"].as_str(), refused["details"]["reason"].as_str()),
        (404, Some("NOT_FOUND"), Some("unknown"))
    );
    // A node takes console tunnels only.
    let (status, refused) = server.call("tunnels.open", json!({ "op": "exec", "nodeId": node })).await;
    assert_eq!((status, refused["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{refused}");

    let events = tunnel_events(&server).await;
    let refusals: Vec<&Value> = events.iter().filter(|e| e["type"] == "tunnel.refused").collect();
    let said: Vec<(&str, &str, &str)> = refusals
        .iter()
        .map(|e| {
            (e["payload"]["reason"].as_str().unwrap(), e["payload"]["keyId"].as_str().unwrap(), e["actor"].as_str().unwrap())
        })
        .collect();
    let other_actor = format!("apikey:{other_key}");
    let admin_actor = format!("apikey:{admin_key}");
    assert_eq!(
        said,
        [
            ("other-key", other_key, other_actor.as_str()),
            ("spent", &*admin_key, &*admin_actor),
            ("expired", &*admin_key, &*admin_actor)
        ],
        "{refusals:?}"
    );
    for refused in &refusals {
        assert_eq!(refused["stream"], format!("node/{node}"));
        assert_eq!(
            (refused["payload"]["op"].as_str(), refused["payload"]["ticketKeyId"].as_str()),
            (Some("console"), Some(&*admin_key))
        );
        assert!(refused["payload"]["from"].as_str().unwrap().starts_with("127.0.0.1:"), "{refused}");
    }
    for secret in [&ticket, &late] {
        assert!(!events.iter().any(|e| e.to_string().contains(secret.as_str())), "a ticket is in the log");
        assert!(!server.log_text().contains(secret.as_str()), "a ticket is in the server's log");
    }
}

/// The client written from schema/TUNNELS.md alone, on Python's `websockets` (PyPI), set to run
/// `command` on `node`'s console as `token`: it prints what the terminal printed, the status as
/// `status: JSON` on stderr, and exits with the remote status (255: the tunnel failed).
fn python_client(server: &Server, node: &str, token: &str, command: &str) -> Command {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = root.join("target/tiles-venv/bin/python");
    assert!(python.exists(), "no Python with websockets at {} (run `make tiles-venv`, which `make test` runs)", python.display());
    let mut client = Command::new(python);
    client
        .arg(root.join("tests/scripts/tunnel_client.py"))
        .args(["--url", &server.url, "--node", node, "--command", command])
        .env("BETTER_COMPUTE_TOKEN", token);
    client
}

/// [`python_client`] started in the background, its output piped.
fn python_console(server: &Server, node: &str, token: &str, command: &str) -> Child {
    python_client(server, node, token, command).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
}

/// Waits at most `within` for `client` to exit (killed past it): its status, stdout and stderr.
fn client_exits(mut client: Child, within: Duration) -> (i32, String, String) {
    let deadline = Instant::now() + within;
    let status = loop {
        if let Some(status) = client.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = client.kill();
            let out = client.wait_with_output().unwrap();
            panic!("the client is still running after {within:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (mut out, mut err) = (String::new(), String::new());
    client.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    client.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    (status.code().unwrap_or(-1), out, err)
}

/// The channel 3 status the Python client printed.
fn printed_status(stderr: &str) -> Value {
    let line = stderr.lines().find_map(|l| l.strip_prefix("status: ")).unwrap_or_else(|| panic!("no status: {stderr}"));
    serde_json::from_str(line).unwrap()
}

/// The first event of `event_type` in the log, once it is there.
fn event_of(server: &Server, event_type: &str) -> Value {
    wait_until(&format!("{event_type} is in the log"), Duration::from_secs(15), || {
        bc_tests::block_on(tunnel_events(server)).into_iter().find(|e| e["type"] == event_type)
    })
}

/// The client was told the tunnel failed (`Failure`, no exit status, `reason`), with a message
/// containing `says`, and exited 255; the tunnel was opened and closed, for `why`, as the log
/// says. Returns `tunnel.closed`.
fn tunnel_ended(server: &Server, client: (i32, String, String), reason: &str, says: &str, why: &str) -> Value {
    let (code, out, err) = client;
    assert_eq!(code, 255, "{out} {err}");
    let status = printed_status(&err);
    assert_eq!((status["status"].as_str(), status["reason"].as_str()), (Some("Failure"), Some(reason)), "{status}");
    assert!(status["message"].as_str().unwrap().contains(says), "{status}");
    let opened = event_of(server, "tunnel.opened");
    let closed = event_of(server, "tunnel.closed");
    assert_eq!(closed["payload"]["tunnelId"], opened["payload"]["tunnelId"]);
    assert_eq!(closed["payload"]["reason"], why, "{closed}");
    assert!(closed["payload"].get("exitStatus").is_none(), "{closed}");
    closed
}

/// A client written from schema/TUNNELS.md alone, on Python's `websockets` (PyPI).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_websockets_client_runs_a_command_on_the_node_console_and_reads_its_status() {
    let (server, port) = bc_tests::agents_gateway();
    let (_machine, node) = running_node(&server, port).await;
    let out = python_client(&server, &node, &server.token, "echo from-python; exit 42").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(42), "{stdout} {}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("from-python"), "{stdout}");

    let events = console_events_say(&server, &node, 42, "echo from-python; exit 42\r".len());
    let closed = &events[1];
    assert!(closed["payload"]["bytesOut"].as_u64().unwrap() > 10, "{closed}");
    assert!(!events.iter().any(|e| e.to_string().contains("from-python")), "nothing typed is logged: {events:?}");
}

/// The node's two tunnel events, with counts and no byte typed or printed: `tunnel.opened` for a
/// console from loopback, `tunnel.closed` with the same id, the remote `exit`, and `typed` bytes in.
/// Returns the two events.
fn console_events_say(server: &Server, node: &str, exit: u64, typed: usize) -> Vec<Value> {
    let events = wait_until("tunnel.closed is in the log", Duration::from_secs(10), || {
        let events = bc_tests::block_on(tunnel_events(server));
        (events.len() == 2).then_some(events)
    });
    let (opened, closed) = (&events[0], &events[1]);
    assert_eq!((opened["type"].as_str(), closed["type"].as_str()), (Some("tunnel.opened"), Some("tunnel.closed")), "{events:?}");
    assert_eq!(opened["stream"], format!("node/{node}"));
    assert_eq!(opened["payload"]["op"], "console");
    assert!(opened["payload"]["from"].as_str().unwrap().starts_with("127.0.0.1:"), "{opened}");
    assert_eq!(closed["payload"]["tunnelId"], opened["payload"]["tunnelId"]);
    assert_eq!(closed["payload"]["exitStatus"], exit);
    assert_eq!(closed["payload"]["reason"], "exited");
    assert_eq!(closed["payload"]["bytesIn"].as_u64().unwrap(), typed as u64, "{closed}");
    events
}

/// A key revoked while its console is open: within a recheck the client is sent a `Failure`
/// status saying so and the socket closes; `tunnel.closed` says `key-revoked`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_revoked_mid_session_ends_its_tunnel() {
    let (server, token) = key_changed_mid_session(("apiKeys.revoke", json!({})), "revoked", "key-revoked").await;
    let (status, refused) = server.call_as(&token, "nodes.list", json!({}), None).await;
    assert_eq!((status, refused["code"].as_str()), (401, Some("UNAUTHENTICATED")), "{refused}");
}

/// A key whose actions no longer include `compute:nodes:console` (`apiKeys.update`) while its
/// console is open: within a recheck the tunnel ends as for a revoked key, and `tunnel.closed`
/// says `access-lost`; the key itself still works for what it kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_that_loses_the_console_action_mid_session_ends_its_tunnel() {
    let (server, token) = key_changed_mid_session(
        ("apiKeys.update", json!({ "actions": ["compute:nodes:read"] })),
        "no longer grants compute:nodes:console",
        "access-lost",
    )
    .await;
    let (status, page) = server.call("events.list", json!({ "types": ["api_key.updated"], "limit": 10 })).await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(page["items"][0]["payload"]["actions"], json!(["compute:nodes:read"]), "{page}");
    let (status, nodes) = server.call_as(&token, "nodes.list", json!({}), None).await;
    assert_eq!(status, 200, "what the key kept still works: {nodes}");
}

/// A console opened with a new key granting `compute:nodes:console` and `compute:nodes:read`,
/// then `change` (a method and its input, the key's id added) made to the key: the client exits
/// within a recheck with a `Failure` status whose message contains `says`, and `tunnel.closed`
/// says `why`. Returns the server and the key's token.
async fn key_changed_mid_session(change: (&str, Value), says: &str, why: &str) -> (Server, String) {
    let (server, port) = bc_tests::agents_gateway();
    let (machine, node) = running_node(&server, port).await;
    let actions = json!(["compute:nodes:console", "compute:nodes:read"]);
    let (status, key) = server.call("apiKeys.create", json!({ "name": "ops", "actions": actions })).await;
    assert_eq!(status, 200, "{key}");
    let client = python_console(&server, &node, key["token"].as_str().unwrap(), "echo ready; sleep 600");
    let opened = event_of(&server, "tunnel.opened");
    assert_eq!(opened["actor"], format!("apikey:{}", key["keyId"].as_str().unwrap()));
    let (method, mut input) = change;
    input["keyId"] = key["keyId"].clone();
    let (status, changed) = server.call(method, input).await;
    assert_eq!(status, 200, "{changed}");
    let changed_at = Instant::now();
    let exited = client_exits(client, Duration::from_secs(20));
    let within = Duration::from_secs(bc_gateway::tunnels::TUNNEL_RECHECK_S + 3);
    assert!(changed_at.elapsed() < within, "ended {:?} after {method}", changed_at.elapsed());
    tunnel_ended(&server, exited, "InternalError", says, why);
    drop(machine);
    (server, key["token"].as_str().unwrap().to_owned())
}

/// A console open past `--tunnel-max-duration` ends: the client is told (`Timeout`), and
/// `tunnel.closed` says `max-duration` after about that long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_past_its_maximum_duration_ends() {
    let (server, port) = bc_tests::agents_gateway_with(&["--tunnel-max-duration", "2s"]);
    let (_machine, node) = running_node(&server, port).await;
    // It prints every half second: the idle timeout never comes.
    let client = python_console(&server, &node, &server.token, "while true; do echo tick; sleep 0.5; done");
    let exited = client_exits(client, Duration::from_secs(20));
    assert!(exited.1.contains("tick"), "{exited:?}");
    let closed = tunnel_ended(&server, exited, "Timeout", "maximum duration of 2 s", "max-duration");
    let lasted = closed["payload"]["durationMs"].as_u64().unwrap();
    assert!((2_000..4_000).contains(&lasted), "{closed}");
    assert!(closed["payload"]["bytesOut"].as_u64().unwrap() > 0, "{closed}");
}

/// A console where nothing passes either way for `--tunnel-idle-timeout` ends: the client is told
/// (`Timeout`), and `tunnel.closed` says `idle-timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_tunnel_ends_at_its_idle_timeout() {
    let (server, port) = bc_tests::agents_gateway_with(&["--tunnel-idle-timeout", "2s"]);
    let (_machine, node) = running_node(&server, port).await;
    let client = python_console(&server, &node, &server.token, "sleep 600");
    let exited = client_exits(client, Duration::from_secs(20));
    let closed = tunnel_ended(&server, exited, "Timeout", "no data either way for 2 s", "idle-timeout");
    assert!(closed["payload"]["durationMs"].as_u64().unwrap() >= 2_000, "{closed}");
}

/// The node's agent killed mid-session: the client sees the tunnel break (a `Failure` status
/// saying the agent went away), and `tunnel.closed` says `agent-gone`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_agent_mid_session_breaks_the_tunnel() {
    let (server, port) = bc_tests::agents_gateway();
    let (mut machine, node) = running_node(&server, port).await;
    let client = python_console(&server, &node, &server.token, "echo ready; sleep 600");
    event_of(&server, "tunnel.opened");
    machine.kill9();
    let exited = client_exits(client, Duration::from_secs(20));
    tunnel_ended(&server, exited, "InternalError", "agent went away", "agent-gone");
}
