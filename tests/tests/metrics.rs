//! `/metrics` scraped by a real Prometheus (Debian's `prometheus`, which `scripts/system-deps`
//! installs): the test starts it on a loopback port with a scrape configuration for the `dev`
//! under test (every second), makes traffic, and asks Prometheus' HTTP API with PromQL for the
//! request rate and the 99th percentile of the latency. `promtool check metrics` passes on what
//! `/metrics` serves. With `--metrics-listen`, the metrics are served there and not on the API.
//! A joined `bcd node` with `[metrics] listen` is scraped beside `dev` by the same Prometheus:
//! its session, commands and heartbeat latency are seen through PromQL, and `promtool` passes
//! on its text too.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bc_tests::{AgentNode, Server, free_port, wait_until};
use serde_json::{Value, json};

/// A Prometheus server of this test: killed when dropped.
struct Prometheus {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    /// Prometheus on a free loopback port, scraping `target` (`HOST:PORT`) at `/metrics` every
    /// second.
    fn scraping(target: &str) -> Prometheus {
        Self::scraping_jobs(&[("better-compute", target)])
    }

    /// Prometheus scraping each `(job, target)` at `/metrics` every second.
    fn scraping_jobs(jobs: &[(&str, &str)]) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("prometheus.yml");
        let mut text = String::from("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n");
        for (job, target) in jobs {
            text.push_str(&format!(
                "  - job_name: {job}\n    metrics_path: /metrics\n    static_configs:\n      - targets: ['{target}']\n"
            ));
        }
        std::fs::write(&config, text).unwrap();
        let port = free_port();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("prometheus (Debian's package; `make test` installs it through scripts/system-deps)");
        let prometheus = Prometheus { child, url: format!("http://127.0.0.1:{port}"), _dir: dir };
        wait_until("Prometheus is ready", Duration::from_secs(30), || {
            let ready = bc_tests::block_on(reqwest::get(format!("{}/-/ready", prometheus.url))).ok()?;
            ready.status().is_success().then_some(())
        });
        prometheus
    }

    /// The vector an instant PromQL query gives (`data.result`), from synchronous code (the
    /// closures of `wait_until`).
    fn query(&self, promql: &str) -> Vec<Value> {
        let url = reqwest::Url::parse_with_params(&format!("{}/api/v1/query", self.url), &[("query", promql)]).unwrap();
        let request = reqwest::Client::new().get(url);
        let answer: Value = bc_tests::block_on(async { request.send().await.unwrap().json().await.unwrap() });
        assert_eq!(answer["status"], "success", "{promql}: {answer}");
        answer["data"]["result"].as_array().cloned().unwrap_or_default()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A sample's value (`value: [time, "number"]`).
fn value_of(sample: &Value) -> f64 {
    sample["value"][1].as_str().and_then(|v| v.parse().ok()).unwrap_or(f64::NAN)
}

/// `promtool check metrics` on `text`: its status and what it said.
fn promtool_check(text: &str) -> (bool, String) {
    use std::io::Write;
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian's prometheus package)");
    promtool.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = promtool.wait_with_output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_the_api_and_sees_the_traffic_made() {
    let server = Server::dev();
    let prometheus = Prometheus::scraping(server.url.trim_start_matches("http://"));
    // Its first scrape (its scrape manager starts the targets some seconds after it is ready),
    // so the traffic below is seen as a change between scrapes.
    wait_until("Prometheus scrapes the server", Duration::from_secs(60), || {
        let up = prometheus.query("up{job=\"better-compute\"}");
        (up.first().map(value_of) == Some(1.0)).then_some(())
    });
    // Traffic: writes (pools.create), reads, and refusals, over a few scrapes.
    for round in 0..5 {
        for i in 0..20 {
            server.pool(&format!("p-{round}-{i}")).await;
        }
        let (status, _) = server.call("pools.get", json!({ "poolId": "pool_nonexistent" })).await;
        assert_ne!(status, 200);
        tokio::time::sleep(Duration::from_millis(400)).await;
    }

    let rates = wait_until("Prometheus has the request rate", Duration::from_secs(30), || {
        let rates = prometheus.query("rate(better_compute_http_requests_total[1m])");
        let posts_ok = rates.iter().find(|s| s["metric"]["method"] == "POST" && s["metric"]["code"] == "200")?;
        (value_of(posts_ok) > 0.0).then_some(rates)
    });
    assert!(
        rates.iter().any(|s| s["metric"]["method"] == "POST" && s["metric"]["code"].as_str().is_some_and(|c| c.starts_with('4'))),
        "the refusals are counted by their code: {rates:?}"
    );
    let p99 =
        prometheus.query("histogram_quantile(0.99, sum by (le) (rate(better_compute_http_request_duration_seconds_bucket[1m])))");
    let p99 = p99.first().map(value_of).unwrap_or(f64::NAN);
    assert!(p99 > 0.0 && p99 <= 30.0, "the 99th percentile of the latency is a number of seconds: {p99}");
    // The 100 pools' events (and the bootstrap's two), once a scrape after the last write is in.
    wait_until("Prometheus has the appends", Duration::from_secs(30), || {
        let appended = prometheus.query("sum(better_compute_log_events_appended_total)");
        (appended.first().map(value_of).unwrap_or(0.0) >= 100.0).then_some(())
    });
    let batches = prometheus.query("sum(better_compute_log_batch_events_count)");
    assert!(batches.first().map(value_of).unwrap_or(0.0) >= 1.0, "batch sizes are observed: {batches:?}");
    let passes = prometheus.query("sum(better_compute_reconciler_passes_total)");
    assert!(passes.first().map(value_of).unwrap_or(0.0) >= 1.0, "reconciler passes are counted: {passes:?}");

    // What /metrics serves passes promtool's checks (the text format a plain GET gets).
    let text = reqwest::get(format!("{}/metrics", server.url)).await.unwrap().text().await.unwrap();
    assert!(text.contains("better_compute_http_requests_total{"), "{text}");
    let (ok, said) = promtool_check(&text);
    assert!(ok, "promtool check metrics: {said}");
}

#[tokio::test]
async fn with_metrics_listen_the_metrics_are_served_there_and_not_on_the_api() {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let server = Server::dev_with(&["--metrics-listen", &listen]);
    server.pool("p").await;
    let scraped = reqwest::Client::new()
        .get(format!("http://{listen}/metrics"))
        .header("accept", "application/openmetrics-text; version=1.0.0")
        .send()
        .await
        .unwrap();
    assert_eq!(scraped.status().as_u16(), 200);
    let content_type = scraped.headers()["content-type"].to_str().unwrap().to_owned();
    assert!(content_type.starts_with("application/openmetrics-text"), "{content_type}");
    let text = scraped.text().await.unwrap();
    assert!(text.contains("better_compute_http_requests_total{method=\"POST\",code=\"200\"}"), "{text}");
    assert!(text.ends_with("# EOF\n"), "OpenMetrics ends with # EOF: {text}");
    let on_api = reqwest::get(format!("{}/metrics", server.url)).await.unwrap();
    assert_ne!(on_api.status().as_u16(), 200, "not on the API's address when --metrics-listen is given");
}

/// bcd's own metrics (`[metrics] listen`): a real Prometheus scrapes `dev` and a joined `bcd
/// node` together; PromQL sees bcd's session live, the pings it ran by kind and outcome, and
/// its heartbeats' latency; `promtool check metrics` passes on bcd's text; bcd answers nothing
/// but `GET /metrics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_a_bcd_beside_dev() {
    let (server, port) = bc_tests::agents_gateway();
    let pool = server.pool("metrics").await;
    let mut node = AgentNode::new(&server, port);
    let listen = format!("127.0.0.1:{}", free_port());
    let config = std::fs::read_to_string(node.config()).unwrap();
    std::fs::write(node.config(), format!("{config}\n[metrics]\nlisten = \"{listen}\"\n")).unwrap();
    node.join_pool(&server, &pool).await;
    node.start();
    wait_until("bcd node's session is live", Duration::from_secs(30), || {
        node.status().filter(|s| s["session"] == "live").map(|_| ())
    });
    let node_id = node.node_id();
    for _ in 0..3 {
        let (status, command) = server.call("commands.issue", json!({ "nodeId": node_id, "kind": "ping" })).await;
        assert_eq!(status, 200, "{command}");
    }
    let dev = server.url.trim_start_matches("http://").to_owned();
    let prometheus = Prometheus::scraping_jobs(&[("better-compute", &dev), ("bcd", &listen)]);
    wait_until("Prometheus scrapes both", Duration::from_secs(60), || {
        let up = prometheus.query("up");
        (up.len() == 2 && up.iter().all(|s| value_of(s) == 1.0)).then_some(())
    });
    wait_until("Prometheus sees bcd's pings and its live session", Duration::from_secs(30), || {
        let pings = prometheus.query("sum(bcd_commands_total{job=\"bcd\",kind=\"ping\",outcome=\"succeeded\"})");
        let live = prometheus.query("bcd_session_state{job=\"bcd\",state=\"live\"}");
        (pings.first().map(value_of) == Some(3.0) && live.first().map(value_of) == Some(1.0)).then_some(())
    });
    let heartbeats = wait_until("Prometheus sees the heartbeats' latency", Duration::from_secs(30), || {
        let p99 = prometheus
            .query("histogram_quantile(0.99, sum by (le) (rate(bcd_heartbeat_latency_seconds_bucket{job=\"bcd\"}[1m])))");
        p99.first().map(value_of).filter(|v| v.is_finite() && *v > 0.0)
    });
    assert!(heartbeats <= 30.0, "a heartbeat's round trip in seconds: {heartbeats}");
    let depth = prometheus.query("bcd_journal_unacked_entries{job=\"bcd\"}");
    assert_eq!(depth.len(), 1, "the journal's depth is a series: {depth:?}");
    let sessions = prometheus.query("sum(better_compute_agent_sessions{job=\"better-compute\"})");
    assert_eq!(sessions.first().map(value_of), Some(1.0), "dev's side of the same session: {sessions:?}");

    let text = reqwest::get(format!("http://{listen}/metrics")).await.unwrap().text().await.unwrap();
    for name in ["bcd_commands_total{", "bcd_holds ", "bcd_journal_unacked_entries ", "bcd_heartbeat_latency_seconds_bucket{"] {
        assert!(text.contains(name), "{name} in {text}");
    }
    let (ok, said) = promtool_check(&text);
    assert!(ok, "promtool check metrics on bcd's: {said}");
    let client = reqwest::Client::new();
    assert_eq!(client.get(format!("http://{listen}/")).send().await.unwrap().status().as_u16(), 404);
    assert_eq!(client.post(format!("http://{listen}/metrics")).send().await.unwrap().status().as_u16(), 405);
}

/// A sample's value in the Prometheus text (`NAME{LABELS} VALUE`), or none.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// What the gateway counts of the work beyond the API: a webhook delivered to a loopback
/// receiver (its outcome and the attempt's latency), the outbox's pending and dead items, the
/// log's tenants and its longest chains' heads and checkpoint lag (read at start, then every
/// `METRICS_REFRESH_MS`), and a joined agent's heartbeats, their gaps and its journal entries;
/// `promtool check metrics` passes on the whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_outcomes_the_outbox_the_log_and_agents_sessions_are_counted() {
    let (server, port) = bc_tests::agents_gateway();
    let receiver = bc_tests::RecordingListener::start(Some("HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n".into()));
    let secret = server.data_dir.join("webhook.secret").display().to_string();
    let endpoint = format!("http://{}/hook", receiver.addr);
    let create = ["webhooks", "create", "--endpoint", &endpoint, "--types", "pool.created", "--secret-out", &secret];
    let (code, out, err) = server.cli(&create);
    assert_eq!(code, 0, "webhooks create: {out} {err}");
    let pool = server.pool("counted").await;
    let mut node = AgentNode::new(&server, port);
    node.join_pool(&server, &pool).await;
    node.start();
    let metrics = || bc_tests::block_on(async { reqwest::get(format!("{}/metrics", server.url)).await.ok()?.text().await.ok() });
    let text = wait_until("a delivery done and the agent's heartbeats counted", Duration::from_secs(30), || {
        let text = metrics()?;
        let delivered = sample(&text, "better_compute_outbox_items_total{consumer=\"webhooks\",outcome=\"done\"}")?;
        let gaps = sample(&text, "better_compute_agent_heartbeat_gap_seconds_count")?;
        (delivered >= 1.0 && gaps >= 2.0).then_some(text)
    });
    assert!(receiver.accepted() >= 1, "the receiver was called");
    let attempts = sample(&text, "better_compute_outbox_attempt_duration_seconds_count{consumer=\"webhooks\"}");
    assert!(attempts.is_some_and(|n| n >= 1.0), "{text}");
    assert!(sample(&text, "better_compute_agent_heartbeats_total").is_some_and(|n| n >= 3.0), "{text}");
    let appended = sample(&text, "better_compute_agent_journal_entries_total{outcome=\"appended\"}");
    assert!(appended.is_some_and(|n| n >= 1.0), "the node's journal entries: {text}");
    assert!(text.contains("better_compute_agent_journal_append_duration_seconds_bucket{"), "{text}");
    // Read from the database at start: the root tenant's chain (the bootstrap's events).
    assert!(sample(&text, "better_compute_log_tenants").is_some_and(|n| n >= 1.0), "{text}");
    assert!(text.contains("better_compute_log_head_seq{tenant=\"ten_"), "{text}");
    assert!(text.contains("better_compute_checkpoint_lag_events{tenant=\"ten_"), "{text}");
    assert_eq!(sample(&text, "better_compute_outbox_items_dead{consumer=\"webhooks\"}"), Some(0.0), "{text}");
    assert!(sample(&text, "better_compute_outbox_items_pending{consumer=\"webhooks\"}").is_some(), "{text}");
    let (ok, said) = promtool_check(&text);
    assert!(ok, "promtool check metrics: {said}");
    assert_eq!(node.stop(), 0);
}

/// A watcher caught up on the shared tail is counted, none behind, none handed back, and the
/// tail's lag behind the log is a series.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caught_up_watcher_is_counted_with_the_tails_lag() {
    let server = Server::dev();
    let mut stream = server.http.get(format!("{}/watch", server.url)).bearer_auth(&server.token).send().await.unwrap();
    assert_eq!(stream.status().as_u16(), 200);
    for i in 0..5 {
        server.pool(&format!("w-{i}")).await;
    }
    // The stream delivers: the watcher is joined to the tail.
    let first = tokio::time::timeout(Duration::from_secs(10), stream.chunk()).await.expect("a frame in time").unwrap();
    assert!(first.is_some());
    let text = wait_until("the watcher counted as caught up", Duration::from_secs(10), || {
        let text = bc_tests::block_on(async { reqwest::get(format!("{}/metrics", server.url)).await.ok()?.text().await.ok() })?;
        (sample(&text, "better_compute_watchers") == Some(1.0) && sample(&text, "better_compute_watchers_behind") == Some(0.0))
            .then_some(text)
    });
    assert_eq!(sample(&text, "better_compute_watch_slow_handbacks_total"), Some(0.0), "{text}");
    assert!(sample(&text, "better_compute_watch_tail_lag_commits").is_some(), "{text}");
    let (ok, said) = promtool_check(&text);
    assert!(ok, "promtool check metrics: {said}");
}
