//! Where a webhook delivery may connect: only to the addresses the deployment's policy admits,
//! checked on every address a receiver's name resolves to (in process, through a resolver the
//! test controls), never to a redirect's target and never through a proxy from the environment
//! (both through the real binaries). A listener that counts connections stands where the
//! delivery must not go.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bc_core::clock::SystemClock;
use bc_core::event::Position;
use bc_core::store::EventStore;
use bc_core::store::outbox::{WorkItem, WorkState};
use bc_core::webhook::EndpointPolicy;
use bc_reconcilers::outbox::Consumer;
use bc_reconcilers::webhooks::{Resolver, Webhooks};
use bc_tests::receiver::Receiver;
use bc_tests::{Reconciler, RecordingListener, Server};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(30);
/// The receiver's name: under `.test`, which no real resolver answers.
const RECEIVER_HOST: &str = "receiver.example.test";

/// Answers every name with `addresses`, and records the names asked.
struct FakeResolver {
    addresses: Vec<IpAddr>,
    asked: Mutex<Vec<String>>,
}

#[async_trait]
impl Resolver for FakeResolver {
    async fn lookup(&self, host: &str) -> std::io::Result<Vec<IpAddr>> {
        self.asked.lock().unwrap().push(host.to_owned());
        Ok(self.addresses.clone())
    }
}

/// The `pool.created` delivery the webhooks consumer fans out from the log, as a work item.
async fn pool_delivery(store: &dyn EventStore) -> WorkItem {
    let rows = store.read_after_rows(Position::START, None, 1000).await.unwrap();
    let consumer = Webhooks::new(EndpointPolicy::default(), 2000, Arc::new(SystemClock)).unwrap();
    let mut items = consumer.fan_out(store, &rows).await.unwrap();
    assert_eq!(items.len(), 1, "one pool event, one webhook: {items:?}");
    let item = items.pop().unwrap();
    WorkItem {
        tenant: item.tenant,
        consumer: consumer.name().to_owned(),
        id: item.id,
        subject: item.subject,
        payload: item.payload,
        state: WorkState::Pending,
        attempts: 0,
        round_attempts: 0,
        next_at_ms: 0,
        last_error: None,
        created_at_ms: 0,
        updated_at_ms: 0,
        lease_until_ms: 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_resolving_to_a_refused_address_is_never_connected() {
    let server = Server::dev_with(&["--no-reconcilers"]);
    let listener = RecordingListener::start(None);
    let url = format!("https://{RECEIVER_HOST}:{}/hook", listener.addr.port());
    let (status, hook) = server.call("webhooks.create", json!({ "url": url, "eventTypes": ["pool.created"] })).await;
    assert_eq!(status, 200, "{hook}");
    server.pool("p").await;
    let store = bc_core::store::sqlite::SqliteStore::open(&server.sqlite_path()).await.unwrap();
    // The signing secret is sealed under the server's data key: this consumer opens it with it.
    let (keys, _) = bc_core::sealing::load_data_keys(&server.data_dir, false).unwrap();
    bc_core::store::SecretStore::set_data_keys(&store, keys);
    let item = pool_delivery(&store).await;

    let serve = EndpointPolicy::default();
    let dev = EndpointPolicy { allow_loopback: true, allow_private: false };
    let lan = EndpointPolicy { allow_loopback: false, allow_private: true };
    let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let metadata: IpAddr = "169.254.169.254".parse().unwrap();
    let private: IpAddr = "10.1.2.3".parse().unwrap();
    let cases: &[(&str, EndpointPolicy, Vec<IpAddr>)] = &[
        ("loopback where loopback is not allowed", serve, vec![loopback]),
        ("link-local where loopback is allowed", dev, vec![metadata]),
        ("link-local where private addresses are allowed", lan, vec![metadata]),
        ("private where only loopback is allowed", dev, vec![private]),
        ("link-local and private where nothing inside is allowed", serve, vec![metadata, private, loopback]),
        ("IPv6 link-local and loopback", serve, vec!["fe80::1".parse().unwrap(), "::1".parse().unwrap()]),
    ];
    for (what, policy, addresses) in cases {
        let resolver = Arc::new(FakeResolver { addresses: addresses.clone(), asked: Mutex::default() });
        let consumer = Webhooks::with_resolver(*policy, 2000, Arc::new(SystemClock), resolver.clone()).unwrap();
        let handled = consumer.handle(&store, &item, &None).await;
        assert_eq!(*resolver.asked.lock().unwrap(), [RECEIVER_HOST], "{what}: the name went through the resolver");
        assert_eq!(listener.accepted(), 0, "{what}: nothing connected to the refused address: {handled:?}");
        assert!(!handled.ok && !handled.retryable, "{what}: refused for good: {handled:?}");
        let error = handled.error.unwrap_or_default();
        assert!(error.contains("does not deliver to"), "{what}: {error}");
    }

    // The control: the same name admitted (loopback, in dev) does reach the listener, so a
    // connection to it would have been seen. It speaks no TLS, so the attempt is retried.
    let resolver = Arc::new(FakeResolver { addresses: vec![private, loopback], asked: Mutex::default() });
    let consumer = Webhooks::with_resolver(dev, 2000, Arc::new(SystemClock), resolver).unwrap();
    let handled = consumer.handle(&store, &item, &None).await;
    assert!(!handled.ok && handled.retryable, "{handled:?}");
    assert_eq!(listener.accepted(), 1, "only the admitted address was connected to: {handled:?}");
}

/// The delivery attempts of `webhook`, once `done` holds of them.
async fn wait_attempts(server: &Server, webhook: &str, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let deadline = Instant::now() + WAIT;
    loop {
        let (status, page) = server.call("webhooks.deliveries", json!({ "webhookId": webhook })).await;
        assert_eq!(status, 200, "{page}");
        let attempts: Vec<Value> =
            page["items"].as_array().unwrap().iter().flat_map(|d| d["attemptLog"].as_array().unwrap().clone()).collect();
        if done(&attempts) {
            return attempts;
        }
        assert!(Instant::now() < deadline, "timed out: {page:#}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn webhook_to(server: &Server, url: &str) -> String {
    let (status, hook) = server.call("webhooks.create", json!({ "url": url, "eventTypes": ["pool.created"] })).await;
    assert_eq!(status, 200, "{hook}");
    hook["webhookId"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_is_not_followed() {
    let target = RecordingListener::start(None);
    let redirect = format!(
        "HTTP/1.1 307 Temporary Redirect\r\nlocation: http://{}/hook\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
        target.addr
    );
    let receiver = RecordingListener::start(Some(redirect));
    let server = Server::dev_with(&["--retry-base", "100ms", "--retry-attempts", "2"]);
    let webhook = webhook_to(&server, &format!("http://{}/hook", receiver.addr)).await;
    server.pool("p").await;
    // Both attempts are recorded as the 307 they got: neither went on to the target.
    let attempts = wait_attempts(&server, &webhook, |a| a.len() == 2).await;
    assert_eq!(target.accepted(), 0, "the redirect's target was never connected to: {attempts:#?}");
    assert!(attempts.iter().all(|a| a["status"] == 307), "{attempts:#?}");
    assert_eq!(receiver.accepted(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_in_the_environment_is_not_used() {
    let proxy = RecordingListener::start(None);
    let proxy_url = format!("http://{}", proxy.addr);
    let server = Server::dev_with(&["--no-reconcilers"]);
    let receiver = Receiver::start();
    let webhook = webhook_to(&server, &receiver.url).await;
    let dir = tempfile::tempdir().unwrap();
    let data_dir = server.data_dir.display().to_string();
    let mut env: Vec<(&str, &str)> = Vec::new();
    for name in ["HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy"] {
        env.push((name, &proxy_url));
    }
    env.extend([("NO_PROXY", ""), ("no_proxy", "")]);
    let args = ["--only", "webhooks", "--data-dir", &data_dir, "--webhook-allow-loopback", "--retry-attempts", "1"];
    let _reconciler = Reconciler::start_with_env(&args, dir.path(), &env);
    server.pool("p").await;
    let attempts = wait_attempts(&server, &webhook, |a| !a.is_empty()).await;
    assert_eq!(proxy.accepted(), 0, "nothing connected to the proxy: {attempts:#?}");
    assert_eq!(attempts[0]["status"], 204, "delivered straight to the receiver: {attempts:#?}");
    assert_eq!(receiver.received().len(), 1);
}
