//! A webhook receiver on loopback for the tests: it records every request (headers, body, time)
//! and answers as told: fail a message's first N attempts, fail always, or answer slowly.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};

#[derive(Clone, Debug)]
pub struct Received {
    pub id: String,
    pub timestamp: u64,
    pub signature: String,
    pub body: Vec<u8>,
    pub at_ms: u64,
}

#[derive(Default)]
struct Shared {
    received: Mutex<Vec<Received>>,
    /// Attempts seen per message id.
    seen: Mutex<HashMap<String, u32>>,
    fail_first: AtomicU64,
    fail_always: AtomicBool,
    delay_ms: AtomicU64,
    /// While true, each request is recorded on arrival and then held, unanswered, until it
    /// turns false: a test sees a delivery in flight and acts while it is (a kill, a count).
    held: tokio::sync::watch::Sender<bool>,
}

pub struct Receiver {
    pub url: String,
    shared: Arc<Shared>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

async fn hook(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let id = header("webhook-id");
    let attempt = {
        let mut seen = shared.seen.lock().unwrap();
        let n = seen.entry(id.clone()).or_default();
        *n += 1;
        *n
    };
    // Recorded on arrival: a request whose sender dies while this one waits still counts.
    shared.received.lock().unwrap().push(Received {
        id,
        timestamp: header("webhook-timestamp").parse().unwrap_or(0),
        signature: header("webhook-signature"),
        body: body.to_vec(),
        at_ms: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64,
    });
    let mut held = shared.held.subscribe();
    let _ = held.wait_for(|held| !*held).await;
    let delay = shared.delay_ms.load(Ordering::SeqCst);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    let fail = shared.fail_always.load(Ordering::SeqCst) || u64::from(attempt) <= shared.fail_first.load(Ordering::SeqCst);
    if fail { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::NO_CONTENT }
}

impl Receiver {
    pub fn start() -> Receiver {
        let shared = Arc::new(Shared::default());
        let (url_tx, url_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let state = shared.clone();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                url_tx.send(format!("http://{}/hook", listener.local_addr().unwrap())).unwrap();
                let app = axum::Router::new().route("/hook", axum::routing::post(hook)).with_state(state);
                axum::serve(listener, app)
                    .with_graceful_shutdown(async move {
                        let _ = stopped.await;
                    })
                    .await
                    .unwrap();
            });
        });
        let url = url_rx.recv_timeout(Duration::from_secs(10)).expect("receiver started");
        Receiver { url, shared, stop: Some(stop), thread: Some(thread) }
    }

    /// Answers 503 to each message's first `n` attempts.
    pub fn fail_first(&self, n: u64) {
        self.shared.fail_first.store(n, Ordering::SeqCst);
    }

    pub fn fail_always(&self, on: bool) {
        self.shared.fail_always.store(on, Ordering::SeqCst);
    }

    pub fn delay(&self, ms: u64) {
        self.shared.delay_ms.store(ms, Ordering::SeqCst);
    }

    /// Holds every request from now on (recorded on arrival, answered only after `hold(false)`);
    /// `hold(false)` lets the held ones and the next go on as told.
    pub fn hold(&self, on: bool) {
        self.shared.held.send_replace(on);
    }

    pub fn received(&self) -> Vec<Received> {
        self.shared.received.lock().unwrap().clone()
    }

    /// Waits until `done` holds for what was received, or panics after `timeout`.
    pub fn wait_for(&self, timeout: Duration, what: &str, done: impl Fn(&[Received]) -> bool) -> Vec<Received> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let received = self.received();
            if done(&received) {
                return received;
            }
            assert!(std::time::Instant::now() < deadline, "timed out waiting for {what}; received {}", received.len());
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
