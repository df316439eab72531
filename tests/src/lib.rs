//! `bc-tests`: the one harness every end-to-end test uses (STYLE rule 13).
//!
//! [`Server::dev`] starts the real `better-compute dev` binary on `127.0.0.1:0` with a fresh data
//! directory (the agents' endpoint on `127.0.0.1:0` too) and reads the URL and the agents'
//! address and pin it prints; [`Server::serve_postgres`] does the same against a scratch
//! PostgreSQL database. When a test fails (the thread is panicking) the data directory,
//! with the server's log in `server.log`, is kept and its path printed.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

pub mod receiver;
pub mod sushy;

/// A command's standard output as JSON; panics with the text when it is not.
pub fn json(out: &str) -> Value {
    serde_json::from_str(out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
}

/// How long a server may take to print its URL.
pub const START_TIMEOUT_S: u64 = 60;

/// How often [`wait_until`] looks again.
pub const POLL_MS: u64 = 50;

/// Milliseconds since the Unix epoch, on the clock `dev` and `serve` use (the system's).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_millis() as u64
}

/// Polls `check` until it returns `Some`, every [`POLL_MS`], for at most `timeout`; panics with
/// `what` after that. The way a test waits for something to happen (never a fixed sleep).
pub fn wait_until<T>(what: &str, timeout: Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(POLL_MS));
    }
}

/// The directory holding the workspace's binaries (next to this test executable's `deps/`).
pub fn bin_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("BC_BIN_DIR") {
        return PathBuf::from(dir);
    }
    let exe = std::env::current_exe().expect("current exe");
    let deps = exe.parent().expect("deps dir");
    deps.parent().expect("profile dir").to_path_buf()
}

/// The workspace binary `name`, checked to exist and to be up to date: a plain `cargo test`
/// (which builds no binaries) must not run the end-to-end tests against an old build.
pub fn binary(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    assert!(path.exists(), "{} not built; run `cargo build --workspace --bins` (make test does)", path.display());
    if let Some(newer) = source_newer_than(&path) {
        panic!(
            "{} is older than {}, one of the files it is built from: the tests would run an old build\nhint: run `cargo build --workspace --bins` (make test does)",
            path.display(),
            newer.display()
        );
    }
    path
}

/// A source file the binary at `path` was built from that changed after it was built, if any.
/// The list is the binary's own dep-info (`NAME.d`, which cargo writes beside it: every source
/// file and `include_str!` of the workspace it was compiled from), so whenever this says stale,
/// cargo agrees and a build fixes it. Without a dep-info nothing can be told, and that is refused.
pub fn source_newer_than(path: &Path) -> Option<PathBuf> {
    let built = std::fs::metadata(path).and_then(|m| m.modified()).expect("the binary's modification time");
    let dep_info = path.with_extension("d");
    let text = std::fs::read_to_string(&dep_info).unwrap_or_else(|e| {
        panic!(
            "cannot tell whether {} is up to date ({}: {e})\nhint: run `cargo build --workspace --bins`",
            path.display(),
            dep_info.display()
        )
    });
    // `TARGET: SOURCE SOURCE …`, spaces inside a path escaped as `\ `. A first line of another
    // shape is refused, never taken for "fresh": nothing could be told from it.
    let Some((_, sources)) = text.lines().next().unwrap_or_default().split_once(": ") else {
        panic!(
            "cannot tell whether {} is up to date: {} does not start with `TARGET: SOURCES`\nhint: run `cargo build --workspace --bins`",
            path.display(),
            dep_info.display()
        )
    };
    let sources = sources.replace("\\ ", "\u{0}");
    // A source that is gone was deleted (or renamed) after the build: the binary is stale too.
    sources
        .split_whitespace()
        .map(|s| PathBuf::from(s.replace('\u{0}', " ")))
        .find(|source| std::fs::metadata(source).and_then(|m| m.modified()).map_or(true, |changed| changed > built))
}

/// Raises this process's soft open-file limit to at least `wanted` (to the hard limit, as the
/// server does for itself), for a test that holds many connections; fails, saying what to do,
/// when even the hard limit is lower.
pub fn raise_open_file_limit(wanted: u64) {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    if let (Some(current), Some(maximum)) = (limit.current, limit.maximum)
        && current < maximum
    {
        setrlimit(Resource::Nofile, Rlimit { current: Some(maximum), maximum: Some(maximum) })
            .expect("raise the open-file limit");
    }
    let now = getrlimit(Resource::Nofile).current;
    assert!(
        now.is_none_or(|n| n >= wanted),
        "this test holds {wanted} open files and the hard limit is {now:?}\nhint: raise it (ulimit -Hn {wanted}) and run again"
    );
}

/// Runs `better-compute ARGS` to completion with `env`; returns (status, stdout, stderr).
pub fn cli(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    cli_stdin(args, env, None)
}

/// `cli` with `input` on standard input. The user's own credentials file is never read: unless
/// `env` names one, `BETTER_COMPUTE_CREDENTIALS` points at a file that does not exist.
pub fn cli_stdin(args: &[&str], env: &[(&str, &str)], input: Option<&str>) -> (i32, String, String) {
    use std::io::Write;
    let mut command = Command::new(binary("better-compute"));
    command.args(args).env_remove("BETTER_COMPUTE_TOKEN").env_remove("BETTER_COMPUTE_URL").env_remove("BETTER_COMPUTE_TENANT");
    command.env_remove("BETTER_COMPUTE_DATABASE_URL").env_remove("BETTER_COMPUTE_PROFILE");
    command.env("BETTER_COMPUTE_CREDENTIALS", "/nonexistent/bc-tests/credentials.json");
    for (k, v) in env {
        command.env(k, v);
    }
    command.stdin(if input.is_some() { Stdio::piped() } else { Stdio::null() }).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = command.spawn().expect("run better-compute");
    if let Some(text) = input {
        // A command that refuses before it reads its input (a refused URL) may exit first: the
        // write then meets a closed pipe, and the exit status and output are what is checked.
        match child.stdin.take().expect("stdin").write_all(text.as_bytes()) {
            Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => panic!("write stdin: {e}"),
            _ => {}
        }
    }
    let out = child.wait_with_output().expect("run better-compute");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

std::thread_local! {
    /// The log filter of the next server this thread starts ([`Server::with_log_filter`]).
    static LOG_FILTER: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
    /// More environment of the next server this thread starts ([`Server::with_env`]).
    static SERVER_ENV: std::cell::RefCell<Vec<(String, String)>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `sim run`'s arguments for a small run at `seed`: 6 nodes, 1 tenant, one simulated hour.
pub fn small_sim_run(seed: &str) -> Vec<&str> {
    vec!["--seed", seed, "--nodes", "6", "--tenants", "1", "--hours", "1"]
}

pub struct Server {
    child: Option<Child>,
    pub url: String,
    /// The agents' endpoint, `HOST:PORT` (from the `  agents:` line).
    pub agents_addr: String,
    /// The serving certificate's pin agents check, `sha256/…`; `None` for h2c (`dev
    /// --agents-insecure-h2c`).
    pub agents_pin: Option<String>,
    pub token: String,
    pub data_dir: PathBuf,
    _temp: Option<tempfile::TempDir>,
    args: Vec<String>,
    /// `BETTER_COMPUTE_LOG` of the server (`info,bc_core=debug` unless a test asks).
    log_filter: String,
    /// More of the server's environment ([`Server::with_env`]).
    env: Vec<(String, String)>,
    pub http: reqwest::Client,
}

impl Server {
    /// `better-compute dev` on a fresh data directory.
    pub fn dev() -> Server {
        Self::dev_with(&[])
    }

    /// `better-compute dev` with extra arguments (`--no-reconcilers`, `--retry-base 200ms`, …).
    pub fn dev_with(extra: &[&str]) -> Server {
        Self::try_dev_with(extra).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Server::dev_with`], or what the process said when it stopped before printing its URL.
    fn try_dev_with(extra: &[&str]) -> Result<Server, String> {
        let temp = tempfile::Builder::new().prefix("bc-e2e-").tempdir().expect("tempdir");
        let data_dir = temp.path().to_path_buf();
        let mut args: Vec<String> =
            vec!["dev".into(), "--data-dir".into(), data_dir.display().to_string(), "--listen".into(), "127.0.0.1:0".into()];
        args.extend(extra.iter().map(|a| a.to_string()));
        Self::try_start(with_agents_port(args), data_dir, Some(temp))
    }

    /// Runs `start` (which starts a server) with the server's `BETTER_COMPUTE_LOG` set to
    /// `filter`: `Server::with_log_filter("debug", || Server::dev())`.
    pub fn with_log_filter(filter: &str, start: impl FnOnce() -> Server) -> Server {
        LOG_FILTER.with(|f| *f.borrow_mut() = Some(filter.to_owned()));
        let server = start();
        LOG_FILTER.with(|f| *f.borrow_mut() = None);
        server
    }

    /// Runs `start` (which starts a server) with `env` added to the server's environment.
    pub fn with_env<T>(env: &[(&str, &str)], start: impl FnOnce() -> T) -> T {
        SERVER_ENV.with(|e| *e.borrow_mut() = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
        let server = start();
        SERVER_ENV.with(|e| e.borrow_mut().clear());
        server
    }

    /// The server's log so far (`server.log` in its data directory).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(self.data_dir.join("server.log")).unwrap_or_default()
    }

    /// `better-compute serve` on PostgreSQL (the database must be migrated).
    pub fn serve_postgres(database_url: &str) -> Server {
        Self::serve_postgres_with(database_url, &[])
    }

    /// `better-compute serve` on PostgreSQL with extra arguments.
    pub fn serve_postgres_with(database_url: &str, extra: &[&str]) -> Server {
        let temp = tempfile::Builder::new().prefix("bc-e2e-pg-").tempdir().expect("tempdir");
        let data_dir = temp.path().to_path_buf();
        let mut args = vec![
            "serve".into(),
            "--database-url".into(),
            database_url.into(),
            "--data-dir".into(),
            data_dir.display().to_string(),
            "--listen".into(),
            "127.0.0.1:0".into(),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        Self::start(with_agents_port(args), data_dir, Some(temp))
    }

    /// A second `serve` beside this one: the same database, the same data directory (the log
    /// key and the admin token), its own port. The first keeps the directory alive.
    pub fn serve_beside(&self) -> Server {
        let mut args = self.args.clone();
        // Its own ports (the first's are pinned in its arguments, for its restarts).
        for i in 1..args.len() {
            if args[i - 1] == "--listen" || args[i - 1] == "--agents-listen" {
                args[i] = "127.0.0.1:0".into();
            }
        }
        Self::start(args, self.data_dir.clone(), None)
    }

    /// [`Server::serve_beside`] with `--roles ROLES` (`serve --roles`) instead of this one's.
    pub fn serve_beside_as(&self, roles: &str) -> Server {
        let mut args = self.args.clone();
        for i in 1..args.len() {
            if args[i - 1] == "--listen" || args[i - 1] == "--agents-listen" {
                args[i] = "127.0.0.1:0".into();
            }
        }
        match args.iter().position(|a| a == "--roles") {
            Some(at) => args[at + 1] = roles.into(),
            None => args.extend(["--roles".into(), roles.into()]),
        }
        Self::start(args, self.data_dir.clone(), None)
    }

    fn start(args: Vec<String>, data_dir: PathBuf, temp: Option<tempfile::TempDir>) -> Server {
        Self::try_start(args, data_dir, temp).unwrap_or_else(|e| panic!("{e}"))
    }

    fn try_start(args: Vec<String>, data_dir: PathBuf, temp: Option<tempfile::TempDir>) -> Result<Server, String> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut server = Server {
            child: None,
            url: String::new(),
            agents_addr: String::new(),
            agents_pin: None,
            token: String::new(),
            data_dir,
            _temp: temp,
            args,
            log_filter: LOG_FILTER.with(|f| f.borrow().clone()).unwrap_or_else(|| "info,bc_core=debug".into()),
            env: SERVER_ENV.with(|e| e.borrow().clone()),
            http: harness_client(),
        };
        server.try_launch()?;
        Ok(server)
    }

    fn launch(&mut self) {
        self.try_launch().unwrap_or_else(|e| panic!("{e}"));
    }

    /// Starts the process; `Err` with its log when it stops (or says nothing) before printing
    /// its URL, the process then stopped and reaped, so a caller that tries again leaves none
    /// behind.
    fn try_launch(&mut self) -> Result<(), String> {
        // A fresh client per launch: pooled connections to a killed server are dead.
        self.http = harness_client();
        let log = self.data_dir.join("server.log");
        let mut env = vec![("BETTER_COMPUTE_LOG", self.log_filter.as_str())];
        env.extend(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        let (mut child, lines) = spawn_logged(&self.args, &log, &env);
        let first = try_next_line(&lines, &self.args, &log).inspect_err(|_| {
            let _ = child.kill();
            let _ = child.wait();
        })?;
        self.url = first.rsplit(' ').next().expect("url").to_owned();
        assert!(self.url.starts_with("http://127.0.0.1:"), "unexpected first line {first:?}");
        // `  agents:    https://ADDR (pin sha256/…)` or `  agents:    h2c://ADDR (plaintext, …)`,
        // after the other lines.
        let agents = loop {
            let line = next_line(&lines, &self.args, &log);
            if let Some(rest) = line.strip_prefix("  agents:") {
                break rest.trim().to_owned();
            }
        };
        let (url, detail) = agents.split_once(' ').unwrap_or((agents.as_str(), ""));
        // `none (…)`: a `serve --roles` without the agents' endpoint.
        let (scheme, addr) = if url == "none" {
            ("none", "")
        } else {
            url.split_once("://").unwrap_or_else(|| panic!("unexpected agents line {agents:?}"))
        };
        self.agents_addr = addr.to_owned();
        self.agents_pin = match scheme {
            "https" => {
                let pin = detail.trim_start_matches("(pin ").trim_end_matches(')');
                assert!(pin.starts_with("sha256/"), "unexpected agents line {agents:?}");
                Some(pin.to_owned())
            }
            "h2c" | "none" => None,
            _ => panic!("unexpected agents line {agents:?}"),
        };
        // A restart binds the same addresses, so clients (watchers, agents) can reconnect.
        if let Some(at) = self.args.iter().position(|a| a == "--listen") {
            self.args[at + 1] = self.url.trim_start_matches("http://").to_owned();
        }
        if let Some(at) = self.args.iter().position(|a| a == "--agents-listen") {
            self.args[at + 1] = self.agents_addr.clone();
        }
        self.token = std::fs::read_to_string(self.data_dir.join("admin.token")).expect("admin.token").trim().to_owned();
        self.child = Some(child);
        Ok(())
    }

    /// The agents' endpoint as `bcd`'s `gateway` names it: `https://ADDR`, or `http://ADDR` for
    /// h2c.
    pub fn agents_url(&self) -> String {
        match self.agents_pin {
            Some(_) => format!("https://{}", self.agents_addr),
            None => format!("http://{}", self.agents_addr),
        }
    }

    /// SIGKILL: no chance to flush or clean up.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM and wait: a graceful stop.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM; true if the server exited by itself, successfully, within `within`.
    pub fn stop_graceful(&mut self, within: Duration) -> bool {
        let Some(mut child) = self.child.take() else { return false };
        let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                return status.success();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }

    /// Starts the same command again on the same data directory and database.
    pub fn restart(&mut self) {
        self.kill9();
        self.launch();
    }

    /// The `reconcilers status` rows of this server's database: each reconciler's last recorded
    /// pass per process (`name`, `instance`, `startedAtMs`, `ok`, `counts`).
    pub fn reconciler_passes(&self) -> Vec<Value> {
        let mut args = vec!["reconcilers".to_owned(), "status".into(), "--format".into(), "json".into()];
        match self.args.iter().position(|a| a == "--database-url") {
            Some(at) => args.extend(["--database-url".into(), self.args[at + 1].clone()]),
            None => args.extend(["--data-dir".into(), self.data_dir.display().to_string()]),
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, out, err) = cli(&args, &[]);
        assert_eq!(code, 0, "reconcilers status: {err}");
        json(&out)["items"].as_array().cloned().unwrap_or_default()
    }

    /// Waits until the reconciler `name` (in any process) has recorded a whole pass that began
    /// after `after_ms`: everything committed before `after_ms` has been looked at by it. A
    /// busy reconciler records at most once a second, so this takes up to about that long.
    pub fn wait_reconciler_pass_after(&self, name: &str, after_ms: u64, timeout: Duration) -> Value {
        wait_until(&format!("a {name} reconciler pass begun after {after_ms}"), timeout, || {
            self.reconciler_passes()
                .into_iter()
                .find(|r| r["name"] == name && r["ok"] == true && r["startedAtMs"].as_u64().is_some_and(|t| t > after_ms))
        })
    }

    pub fn sqlite_path(&self) -> PathBuf {
        self.data_dir.join("better-compute.sqlite3")
    }

    /// Runs `statement` on this server's SQLite database behind its back (a test that tampers
    /// with what is stored), on a connection of its own.
    pub async fn sql(&self, statement: &str) {
        let url = format!("sqlite://{}", self.sqlite_path().display());
        let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement.to_owned())).execute(&pool).await.unwrap();
        pool.close().await;
    }

    /// Env for running the CLI against this server as its administrator.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![("BETTER_COMPUTE_URL", self.url.clone()), ("BETTER_COMPUTE_TOKEN", self.token.clone())]
    }

    pub fn cli(&self, args: &[&str]) -> (i32, String, String) {
        let env = self.env();
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        cli(args, &env)
    }

    /// POST a method as the administrator; returns (HTTP status, JSON body).
    pub async fn call(&self, method: &str, body: Value) -> (u16, Value) {
        self.call_as(&self.token, method, body, None).await
    }

    pub async fn call_as(&self, token: &str, method: &str, body: Value, idempotency_key: Option<&str>) -> (u16, Value) {
        let mut request = self.http.post(format!("{}/api/compute/{method}", self.url)).bearer_auth(token).json(&body);
        if let Some(key) = idempotency_key {
            request = request.header("idempotency-key", key);
        }
        let response = request.send().await.expect("request");
        let status = response.status().as_u16();
        let body = response.json().await.unwrap_or(Value::Null);
        (status, body)
    }

    /// POST raw bytes with the given headers.
    pub async fn raw(&self, method: &str, body: Vec<u8>, headers: &[(&str, &str)]) -> (u16, Value) {
        let mut request = self.http.post(format!("{}/api/compute/{method}", self.url)).body(body);
        for (k, v) in headers {
            request = request.header(*k, *v);
        }
        let response = request.send().await.expect("request");
        (response.status().as_u16(), response.json().await.unwrap_or(Value::Null))
    }

    /// Creates tenant `name` as the root administrator; its id.
    pub async fn tenant(&self, name: &str) -> String {
        let (status, tenant) = self.call("tenants.create", json!({ "name": name })).await;
        assert_eq!(status, 200, "{tenant}");
        tenant["tenantId"].as_str().unwrap().to_owned()
    }

    /// Creates pool `name` in `tenant` as the root administrator; its id.
    pub async fn tenant_pool(&self, tenant: &str, name: &str) -> String {
        let (status, pool) = self.call("pools.create", json!({ "tenantId": tenant, "name": name })).await;
        assert_eq!(status, 200, "{pool}");
        pool["poolId"].as_str().unwrap().to_owned()
    }

    /// Stops the server, rotates its log key with `pki rotate-log-key`, and starts it again; what
    /// the rotation printed.
    pub fn rotate_log_key_offline(&mut self) -> Value {
        self.stop();
        let (code, out, err) = cli(&["pki", "rotate-log-key", "--data-dir", self.data_dir.to_str().unwrap()], &[]);
        assert_eq!(code, 0, "{err}");
        self.restart();
        json(&out)
    }

    /// Registers `count` nodes `n0`, `n1`, … in `pool`, each with four H100s on one NVLink
    /// domain; their ids, in order.
    pub async fn h100_nodes(&self, pool: &str, count: usize) -> Vec<String> {
        let gpus = vec![json!({ "model": "H100", "product": "H100-SXM5-80GB", "vramGiB": 80, "nvlinkDomain": 0 }); 4];
        let mut ids = Vec::new();
        for n in 0..count {
            let (status, node) =
                self.call("nodes.register", json!({ "poolId": pool, "name": format!("n{n}"), "gpus": gpus })).await;
            assert_eq!(status, 200, "{node}");
            ids.push(node["nodeId"].as_str().unwrap().to_owned());
        }
        ids
    }

    /// Creates a pool and returns its id.
    pub async fn pool(&self, name: &str) -> String {
        let (status, body) = self.call("pools.create", json!({ "name": name })).await;
        assert_eq!(status, 200, "{body}");
        body["poolId"].as_str().expect("poolId").to_owned()
    }

    /// The number of the newest append transaction, from `/readyz`.
    pub async fn last_commit(&self) -> u64 {
        let body: Value =
            self.http.get(format!("{}/readyz", self.url)).send().await.expect("healthz").json().await.expect("json");
        body["lastCommit"].as_u64().expect("lastCommit")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill9();
        if std::thread::panicking()
            && let Some(temp) = self._temp.take()
        {
            let kept = temp.keep();
            eprintln!("test failed: kept the data directory {} (server.log has the server's log)", kept.display());
        }
    }
}

/// Reads every chain of a SQLite database written by `dev` and verifies it; returns
/// (events, tenants).
pub async fn verify_sqlite(path: &Path) -> (u64, usize) {
    let store = bc_core::store::sqlite::SqliteStore::open(path).await.expect("open sqlite");
    verify_store(&store).await
}

pub async fn verify_store(store: &dyn bc_core::store::EventStore) -> (u64, usize) {
    let mut keys = bc_core::keys::KeyRing::default();
    for (id, public) in store.signing_keys().await.expect("keys") {
        keys.insert_bytes(&id, &public).expect("key");
    }
    let heads = store.heads().await.expect("heads");
    let mut total = 0;
    for (tenant, head) in &heads {
        let mut verifier = bc_core::chain::ChainVerifier::new(*tenant, &keys);
        let mut from = 1;
        loop {
            let rows = store.read_chain_rows(*tenant, from, 1000).await.expect("rows");
            if rows.is_empty() {
                break;
            }
            from += rows.len() as u64;
            for row in rows {
                verifier.push(row).unwrap_or_else(|p| panic!("chain does not verify: {p}"));
            }
        }
        total += verifier.finish(Some((head.seq, head.hash))).unwrap_or_else(|p| panic!("chain does not verify: {p}"));
    }
    (total, heads.len())
}

/// `--agents-listen 127.0.0.1:0` unless the test chose an address: tests run side by side, so
/// none may take the default port.
fn with_agents_port(mut args: Vec<String>) -> Vec<String> {
    if !args.iter().any(|a| a == "--agents-listen" || a.starts_with("--agents-listen=")) {
        args.extend(["--agents-listen".into(), "127.0.0.1:0".into()]);
    }
    args
}

/// The next line the process printed, within [`START_TIMEOUT_S`]; panics with its log.
fn next_line(lines: &std::sync::mpsc::Receiver<String>, args: &[String], log: &Path) -> String {
    try_next_line(lines, args, log).unwrap_or_else(|e| panic!("{e}"))
}

/// [`next_line`], or its log when the process stopped or said nothing in time.
fn try_next_line(lines: &std::sync::mpsc::Receiver<String>, args: &[String], log: &Path) -> Result<String, String> {
    lines.recv_timeout(Duration::from_secs(START_TIMEOUT_S)).map_err(|_| {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        format!("better-compute {} did not start within {START_TIMEOUT_S}s (or stopped); its log:\n{text}", args.join(" "))
    })
}

/// Starts `better-compute ARGS`, its stderr appended to `log`; its stdout lines come through
/// the receiver (its URL or its banner first), and stdout is drained so the process never
/// blocks on it, also once the receiver is gone.
fn spawn_logged(args: &[String], log: &Path, env: &[(&str, &str)]) -> (Child, std::sync::mpsc::Receiver<String>) {
    let file = std::fs::OpenOptions::new().create(true).append(true).open(log).expect("log file");
    let mut command = Command::new(binary("better-compute"));
    command.args(args).env_remove("BETTER_COMPUTE_DATABASE_URL");
    for (k, v) in env {
        command.env(k, v);
    }
    let mut child = command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(file).spawn().expect("start better-compute");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let _ = tx.send(line);
        }
    });
    (child, rx)
}

/// A `better-compute reconcile` process; its log goes to `reconcile-N.log` in `dir`.
pub struct Reconciler {
    child: Option<Child>,
    args: Vec<String>,
    log: PathBuf,
}

impl Reconciler {
    /// Starts `better-compute reconcile ARGS` and waits for its first line.
    pub fn start(args: &[&str], dir: &Path) -> Reconciler {
        let n = std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0);
        let mut r = Reconciler {
            child: None,
            args: std::iter::once("reconcile").chain(args.iter().copied()).map(str::to_owned).collect(),
            log: dir.join(format!("reconcile-{n}.log")),
        };
        r.launch();
        r
    }

    fn launch(&mut self) {
        let (child, lines) = spawn_logged(&self.args, &self.log, &[]);
        let first = next_line(&lines, &self.args, &self.log);
        assert!(first.starts_with("better-compute reconciling"), "unexpected first line {first:?}");
        self.child = Some(child);
    }

    /// What the process has logged so far (its JSON lines).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Reservations the process has activated, by its own `pass` lines.
    pub fn activated(&self) -> u64 {
        self.log_text()
            .lines()
            .filter_map(|line| serde_json::from_str::<Value>(line).ok())
            .filter(|line| line["fields"]["message"] == "pass")
            .filter_map(|line| line["fields"]["activated"].as_u64())
            .sum()
    }

    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn restart(&mut self) {
        self.kill9();
        self.launch();
    }
}

impl Drop for Reconciler {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Every projection row the log implies, folded here event by event through
/// [`bc_projections::Projections`] (independently of `rebuild_projections`), sorted by key.
pub async fn fold_log(store: &dyn bc_core::store::EventStore) -> Vec<bc_core::store::Row> {
    use bc_core::store::{Projector, RowKey};
    let projector = bc_projections::Projections;
    let mut state: std::collections::BTreeMap<RowKey, Value> = std::collections::BTreeMap::new();
    let mut after = bc_core::event::Position::START;
    let mut keys = Vec::new();
    loop {
        let page = bc_core::store::decode_rows(store.read_after_rows(after, None, 1000).await.expect("read the log"))
            .expect("decode the log");
        let Some(last) = page.last() else { break };
        after = last.position;
        for event in &page {
            keys.clear();
            projector.touches(event, &mut keys);
            for key in keys.drain(..) {
                let current = state.remove(&key);
                if let Some(doc) = projector.apply(&key, current, event).expect("fold an event") {
                    state.insert(key, doc);
                }
            }
        }
    }
    state.into_iter().map(|(key, doc)| bc_core::store::Row { key, doc }).collect()
}

/// Every projection row of `store`, sorted by key.
pub async fn rows_sorted(store: &dyn bc_core::store::EventStore) -> Vec<bc_core::store::Row> {
    let mut rows = store.rows_all().await.expect("projection rows");
    rows.sort_by(|a, b| a.key.cmp(&b.key));
    rows
}

impl Reconciler {
    /// [`Reconciler::start`] with `env` added to the process's environment (a restart drops it).
    pub fn start_with_env(args: &[&str], dir: &Path, env: &[(&str, &str)]) -> Reconciler {
        let n = std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0);
        let args: Vec<String> = std::iter::once("reconcile").chain(args.iter().copied()).map(str::to_owned).collect();
        let log = dir.join(format!("reconcile-{n}.log"));
        let (child, lines) = spawn_logged(&args, &log, env);
        let first = next_line(&lines, &args, &log);
        assert!(first.starts_with("better-compute reconciling"), "unexpected first line {first:?}");
        Reconciler { child: Some(child), args, log }
    }
}

/// A TCP listener on loopback that counts the connections it accepts, and answers each with
/// `response` once the request's headers are in (or closes it at once): to prove that nothing
/// connects to it (a proxy, a redirect's target, a refused address).
pub struct RecordingListener {
    pub addr: std::net::SocketAddr,
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl RecordingListener {
    pub fn start(response: Option<String>) -> RecordingListener {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a recording listener");
        let addr = listener.local_addr().expect("its address");
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = accepted.clone();
        // Lives as long as the test process: a blocked accept has nothing to clean up.
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let Some(response) = response.clone() else { continue };
                let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
                let mut seen = Vec::new();
                let mut buf = [0u8; 4096];
                while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = stream.write_all(response.as_bytes());
            }
        });
        RecordingListener { addr, accepted }
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// The harness's HTTP client: idle connections are dropped well before the gateway's
/// header-read timeout closes them (20 s), so a request never races the server's close of a
/// pooled connection (a POST is not retried: the test would see `IncompleteMessage`).
fn harness_client() -> reqwest::Client {
    let idle = Duration::from_secs(bc_gateway::conn::HEADER_READ_TIMEOUT_S / 2);
    reqwest::Client::builder().timeout(Duration::from_secs(30)).pool_idle_timeout(idle).build().expect("client")
}

/// `len` bytes that begin as a standalone qcow2 (version 3: 64 KiB clusters, no backing file,
/// no header extension), then noise: the node checks a qcow2 disk's header before a domain is
/// defined on it, and neither libvirt's test driver nor the fake hypervisor boots anything.
pub fn qcow2_image(len: usize) -> Vec<u8> {
    let mut bytes: Vec<u8> = (0..len as u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    bytes[..112].fill(0);
    bytes[0..4].copy_from_slice(b"QFI\xfb");
    bytes[4..8].copy_from_slice(&3u32.to_be_bytes());
    bytes[20..24].copy_from_slice(&16u32.to_be_bytes());
    bytes[24..32].copy_from_slice(&(1u64 << 30).to_be_bytes());
    bytes[96..100].copy_from_slice(&4u32.to_be_bytes());
    // The header's length; the 8 zero bytes after it end the (empty) list of extensions.
    bytes[100..104].copy_from_slice(&104u32.to_be_bytes());
    bytes
}

/// Reads a child's stream (a pseudo-terminal's, say) into a shared buffer on a thread of its own,
/// until it ends.
pub fn capture(mut reader: Box<dyn std::io::Read + Send>) -> std::sync::Arc<std::sync::Mutex<Vec<u8>>> {
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = seen.clone();
    std::thread::spawn(move || {
        let mut buffer = [0u8; 4096];
        while let Ok(n @ 1..) = reader.read(&mut buffer) {
            sink.lock().unwrap().extend_from_slice(&buffer[..n]);
        }
    });
    seen
}

/// Waits (20 s at most) until what [`capture`] read shows `what`.
pub fn wait_for(seen: &std::sync::Mutex<Vec<u8>>, what: &str) {
    wait_until(&format!("the terminal shows {what:?}"), Duration::from_secs(20), || {
        String::from_utf8_lossy(&seen.lock().unwrap()).contains(what).then_some(())
    });
}

/// A free loopback port, so a restarted gateway listens where its agents look.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Ports [`agents_gateway`] tries: another test may take a port between [`free_port`] letting
/// it go and the gateway binding it.
const AGENTS_PORT_TRIES: usize = 5;

/// `dev` with its agents' endpoint on a fixed port (see [`free_port`]), a 2 s lease and 300 ms
/// heartbeats: what the tests of nodes that join start. A port taken meanwhile by a test beside
/// it (the gateway stops with `Address already in use`) is given up for another.
pub fn agents_gateway() -> (Server, u16) {
    agents_gateway_with(&[])
}

/// [`agents_gateway`] with more of `dev`'s arguments after those.
pub fn agents_gateway_with(extra: &[&str]) -> (Server, u16) {
    let mut last = String::new();
    for _ in 0..AGENTS_PORT_TRIES {
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        let mut args = vec!["--agents-listen", &listen, "--node-lease", "2s", "--node-heartbeat", "300ms"];
        args.extend_from_slice(extra);
        match Server::try_dev_with(&args) {
            Ok(server) => return (server, port),
            Err(e) if e.contains("Address already in use") => last = e,
            Err(e) => panic!("{e}"),
        }
    }
    panic!("no free agents port in {AGENTS_PORT_TRIES} tries; the last:\n{last}")
}

/// The log key's pin (`pki show`), which a node's `config.toml` names.
pub fn log_key_pin(server: &Server) -> String {
    let (code, out, err) = cli(&["pki", "show", "--data-dir", &server.data_dir.display().to_string()], &[]);
    assert_eq!(code, 0, "pki show: {err}");
    json(&out)["pin"].as_str().unwrap().to_owned()
}

/// Runs a future to its end from synchronous code inside a multi-threaded tokio test (the
/// closures of [`wait_until`]).
pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(f))
}

/// Runs `bcd ARGS` to its end with `env` (never the caller's `BCD_JOIN_TOKEN`) and, if given,
/// `stdin`: (exit status, stdout, stderr). A run past 60 s is killed, so a command that should end
/// but runs on fails the test instead of hanging it.
pub fn bcd(args: &[&str], env: &[(&str, &str)], stdin: Option<&str>) -> (i32, String, String) {
    use std::io::Write;
    let mut child = Command::new(binary("bcd"))
        .args(args)
        .env_remove("BCD_JOIN_TOKEN")
        .envs(env.iter().copied())
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start bcd");
    if let Some(input) = stdin {
        child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    }
    let pid = child.id();
    let (done, watchdog) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        if watchdog.recv_timeout(Duration::from_secs(60)).is_err() {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
        }
    });
    let out = child.wait_with_output().expect("bcd output");
    let _ = done.send(());
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

/// What `bcd hardware --fake-hw SEED` says the fake machine of `seed` holds.
pub fn fake_hardware(seed: u64) -> Value {
    let out = Command::new(binary("bcd")).args(["hardware", "--fake-hw", &seed.to_string()]).output().expect("run bcd");
    assert!(out.status.success(), "bcd hardware: {}", String::from_utf8_lossy(&out.stderr));
    json(&String::from_utf8_lossy(&out.stdout))
}

/// A fake machine with at least `gpus` GPUs: its seed (the first among 1 to 99).
pub fn fake_seed_with(gpus: usize) -> u64 {
    (1..100u64)
        .find(|seed| fake_hardware(*seed)["gpus"]["gpus"].as_array().is_some_and(|g| g.len() >= gpus))
        .expect("a fake machine with enough GPUs among seeds 1..100")
}

/// One machine that runs `bcd node`: its data directory and configuration (the agents'
/// endpoint of `server` on `port`, TLS with its pin, the log key's pin, observations every
/// 150 ms, JSON logs to `node.log`). Killed when dropped; its directory is kept when the test
/// fails.
/// `bcd node --config CONFIG`, its log appended to `dir/node.log`.
pub fn start_bcd_node(dir: &Path, config: &str) -> Child {
    start_bcd_node_with_env(dir, config, &[])
}

/// [`start_bcd_node`] with `env` set in `bcd`'s environment (a `PATH` that lacks a tool).
pub fn start_bcd_node_with_env(dir: &Path, config: &str, env: &[(&str, &str)]) -> Child {
    let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("node.log")).unwrap();
    Command::new(binary("bcd"))
        .args(["node", "--config", config])
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start bcd node")
}

pub struct AgentNode {
    pub dir: tempfile::TempDir,
    node: Option<Child>,
}

impl AgentNode {
    pub fn new(server: &Server, port: u16) -> AgentNode {
        let dir = tempfile::tempdir().unwrap();
        let config = format!(
            "data_dir = {:?}\ngateway = \"https://127.0.0.1:{port}\"\nserving_ca_spki_pin = {:?}\nlog_key_pin = {:?}\nobserve_interval = \"150ms\"\n\n[log]\nlevel = \"info\"\nformat = \"json\"\n",
            dir.path().join("data").display().to_string(),
            server.agents_pin.clone().expect("the agents' endpoint is TLS"),
            log_key_pin(server),
        );
        std::fs::write(dir.path().join("config.toml"), config).unwrap();
        AgentNode { dir, node: None }
    }

    pub fn config(&self) -> String {
        self.dir.path().join("config.toml").display().to_string()
    }

    pub fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    pub fn bcd(&self, args: &[&str], env: &[(&str, &str)], stdin: Option<&str>) -> (i32, String, String) {
        bcd(args, env, stdin)
    }

    /// `bcd ARGS` outside any machine.
    pub fn run_bcd(args: &[&str]) -> (i32, String, String) {
        bcd(args, &[], None)
    }

    pub fn join_stdin(&self, token: &str) -> (i32, String, String) {
        self.bcd(&["join", "--config", &self.config()], &[], Some(&format!("{token}\n")))
    }

    /// Trusts `release_key` for self-updates: a new version confirms within 20 s and counts as
    /// healthy after 1 s.
    pub fn trust_release_key(&self, release_key: &str) {
        let config = std::fs::read_to_string(self.config()).unwrap();
        std::fs::write(
            self.config(),
            format!("{config}\n[update]\nrelease_keys = [{release_key:?}]\nconfirm_within_s = 20\nhealthy_after_s = 1\n"),
        )
        .unwrap();
    }

    /// Joins the machine to `pool` with a one-use token the root administrator makes.
    pub async fn join_pool(&self, server: &Server, pool: &str) {
        let (status, created) = server.call("joinTokens.create", json!({ "poolId": pool, "uses": 1 })).await;
        assert_eq!(status, 200, "{created}");
        let (code, out, err) = self.join_stdin(created["token"].as_str().unwrap());
        assert_eq!(code, 0, "bcd join: {out} {err}");
    }

    pub fn start(&mut self) {
        self.node = Some(start_bcd_node(self.dir.path(), &self.config()));
    }

    /// [`Self::start`] with `env` set in `bcd`'s environment.
    pub fn start_with_env(&mut self, env: &[(&str, &str)]) {
        self.node = Some(start_bcd_node_with_env(self.dir.path(), &self.config(), env));
    }

    pub fn kill9(&mut self) {
        if let Some(mut child) = self.node.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, and the exit code.
    pub fn stop(&mut self) -> i32 {
        let mut child = self.node.take().expect("running");
        let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
        child.wait().unwrap().code().unwrap_or(-1)
    }

    pub fn status(&self) -> Option<Value> {
        let (code, out, _) = self.bcd(&["status", "--config", &self.config()], &[], None);
        (code == 0).then(|| json(&out))
    }

    pub fn node_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("node.log")).unwrap_or_default()
    }

    pub fn node_id(&self) -> String {
        let identity: Value = serde_json::from_str(&std::fs::read_to_string(self.data().join("identity.json")).unwrap()).unwrap();
        let document: Value = serde_json::from_str(identity["identity"].as_str().unwrap()).unwrap();
        document["nodeId"].as_str().unwrap().to_owned()
    }
}

impl Drop for AgentNode {
    fn drop(&mut self) {
        self.kill9();
        if std::thread::panicking() {
            let kept = self.dir.path().to_path_buf();
            std::mem::forget(std::mem::replace(&mut self.dir, tempfile::tempdir().unwrap()));
            eprintln!("kept the machine's directory: {}", kept.display());
        }
    }
}

/// Stops, when dropped, the `bcd node` whose pid file this names: an agent a watchdog started
/// (after an update's rollback) is no child of the test.
pub struct PidGuard(pub PathBuf);

impl Drop for PidGuard {
    fn drop(&mut self) {
        if let Ok(pid) = std::fs::read_to_string(&self.0) {
            let _ = Command::new("kill").args(["-TERM", pid.trim()]).status();
        }
    }
}

/// The pid `bcd node` wrote in the machine's data directory (`bcd.pid`), or empty.
pub fn pid_of(machine: &AgentNode) -> String {
    std::fs::read_to_string(machine.data().join("bcd.pid")).unwrap_or_default().trim().to_owned()
}

/// A loopback HTTP/1.1 server that answers every GET with `bytes`: where the tests' images and
/// release artifacts are fetched from. Counts the requests it received and answered; a gated one
/// ([`ImageServer::gated`]) holds requests unanswered until [`ImageServer::open`], so a test can
/// act while a download is seen in flight.
pub struct ImageServer {
    pub url: String,
    arrived: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    served: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    gate: std::sync::Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
}

impl ImageServer {
    /// Serves `bytes` at `http://127.0.0.1:PORT/NAME`, answering every GET at once.
    pub fn start(name: &str, bytes: Vec<u8>) -> ImageServer {
        Self::gated(name, bytes, usize::MAX)
    }

    /// [`ImageServer::start`], answering its first `free` GETs at once and holding every later
    /// one, unanswered, until [`ImageServer::open`].
    pub fn gated(name: &str, bytes: Vec<u8>, free: usize) -> ImageServer {
        use std::io::{Read, Write};
        use std::sync::atomic::Ordering::SeqCst;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/{name}", listener.local_addr().unwrap());
        let server = ImageServer { url, arrived: Default::default(), served: Default::default(), gate: Default::default() };
        let (arrived, served, gate, bytes) =
            (server.arrived.clone(), server.served.clone(), server.gate.clone(), std::sync::Arc::new(bytes));
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let (arrived, served, gate, bytes) = (arrived.clone(), served.clone(), gate.clone(), bytes.clone());
                std::thread::spawn(move || {
                    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
                    let mut seen = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                        match stream.read(&mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => seen.extend_from_slice(&buf[..n]),
                        }
                    }
                    if arrived.fetch_add(1, SeqCst) >= free {
                        let (open, opened) = &*gate;
                        let _open = opened.wait_while(open.lock().unwrap(), |open| !*open).unwrap();
                    }
                    served.fetch_add(1, SeqCst);
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                        bytes.len()
                    );
                    let _ = stream.write_all(head.as_bytes());
                    let _ = stream.write_all(&bytes);
                });
            }
        });
        server
    }

    /// GETs received so far, held or not.
    pub fn arrived(&self) -> usize {
        self.arrived.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// GETs answered so far.
    pub fn served(&self) -> usize {
        self.served.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Answers the held GETs and every later one.
    pub fn open(&self) {
        let (open, opened) = &*self.gate;
        *open.lock().unwrap() = true;
        opened.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use super::source_newer_than;

    fn set_mtime(path: &std::path::Path, at: SystemTime) {
        std::fs::File::options().write(true).open(path).unwrap().set_modified(at).unwrap();
    }

    #[test]
    fn a_binary_older_than_a_source_it_lists_is_stale() {
        let dir = tempfile::tempdir().unwrap();
        let (bin, old, changed) = (dir.path().join("tool"), dir.path().join("a.rs"), dir.path().join("b c.rs"));
        for path in [&bin, &old, &changed] {
            std::fs::write(path, b"x").unwrap();
        }
        std::fs::write(
            dir.path().join("tool.d"),
            format!(
                "{}: {} {}\n\n{}:\n",
                bin.display(),
                old.display(),
                changed.display().to_string().replace(' ', "\\ "),
                old.display()
            ),
        )
        .unwrap();
        let t0 = SystemTime::now() - Duration::from_secs(3600);
        set_mtime(&old, t0);
        set_mtime(&bin, t0 + Duration::from_secs(10));
        set_mtime(&changed, t0 + Duration::from_secs(20));
        assert_eq!(source_newer_than(&bin), Some(changed.clone()), "edited after the build");
        set_mtime(&bin, t0 + Duration::from_secs(30));
        assert_eq!(source_newer_than(&bin), None, "rebuilt since");
        // A source deleted since the build: stale too.
        std::fs::remove_file(&old).unwrap();
        assert_eq!(source_newer_than(&bin), Some(old.clone()), "a source is gone");
    }

    #[test]
    #[should_panic(expected = "does not start with `TARGET: SOURCES`")]
    fn a_dep_info_of_another_shape_is_refused_not_taken_for_fresh() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("tool");
        std::fs::write(&bin, b"x").unwrap();
        std::fs::write(dir.path().join("tool.d"), "something else entirely\n").unwrap();
        source_newer_than(&bin);
    }
}
