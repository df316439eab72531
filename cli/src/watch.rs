//! `better-compute events watch`: follows `GET /watch`, prints one JSON line per event,
//! reconnects from the last event id it received after a broken connection, and stops on
//! Ctrl-C, after `--count`, or on a refusal (a 4xx answer, or a redirect, which it never follows).
//!
//! Where it starts is the server's default, the end of the log (`tail -f`), unless `--since`
//! names a position or `start`/`0` (the beginning), which is sent as `?since=`.

use std::time::Duration;

use futures::StreamExt;
use serde_json::Value;

use crate::client::{self, CliError};
use crate::output;

/// Reconnect back-off: doubling from the first to the last, reset by a received event.
const RECONNECT_FIRST_MS: u64 = 200;
const RECONNECT_MAX_MS: u64 = 5000;
/// With heartbeats every 15 s, this long without a byte means the connection is dead.
const IDLE_TIMEOUT_S: u64 = 45;
/// Longest SSE line accepted (an event's JSON is far smaller).
const LINE_BYTES_MAX: usize = 1024 * 1024;

/// `--since`: where the watch starts when it is not where the server would (the end).
#[derive(Clone, Debug, PartialEq)]
pub enum Since {
    /// `start` or `0`: replay the log from its first event.
    Start,
    /// Resume after this position (`COMMIT.INDEX`).
    After(bc_core::event::Position),
}

impl Since {
    pub fn parse(text: &str) -> Result<Self, CliError> {
        match text {
            "start" | "0" => Ok(Since::Start),
            _ => text.parse().map(Since::After).map_err(|e| CliError::usage(format!("--since: {e}"))),
        }
    }

    /// The `since` query value: every position is after the start, so the start is position 0.0.
    fn query(&self) -> String {
        match self {
            Since::Start => bc_core::event::Position::START.to_string(),
            Since::After(position) => position.to_string(),
        }
    }
}

pub struct WatchArgs {
    pub url: String,
    pub token: String,
    pub tenant: Option<String>,
    pub types: Option<String>,
    pub since: Option<Since>,
    pub count: Option<u64>,
}

pub async fn watch(args: WatchArgs) -> Result<(), CliError> {
    // The same policy as every API call: plain http only on loopback, checked before anything is
    // sent, and no redirect followed.
    let parsed = client::api_url(&args.url)?;
    let http = client::api_http(&parsed, reqwest::Client::builder().connect_timeout(Duration::from_secs(10)))?;
    let mut progress = Progress { last: None, printed: 0, backoff_ms: RECONNECT_FIRST_MS };
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    loop {
        let mut request = http.get(watch_url(&args, progress.last.as_deref())?).bearer_auth(&args.token);
        if let Some(id) = &progress.last {
            request = request.header("last-event-id", id);
        }
        let response = tokio::select! {
            _ = &mut ctrl_c => return Ok(()),
            r = request.send() => r,
        };
        match response {
            Ok(r) if r.status().is_client_error() && !matches!(r.status().as_u16(), 408 | 429) => return Err(refusal(r).await),
            Ok(r) if r.status().is_redirection() => {
                return Err(client::redirect_refused(r.status(), r.headers().get(reqwest::header::LOCATION)));
            }
            Ok(r) if r.status().is_success() => {
                if let Connection::Done = print_stream(r, &args, &mut progress, ctrl_c.as_mut()).await? {
                    return Ok(());
                }
                match progress.last.clone().or_else(|| args.since.as_ref().map(Since::query)) {
                    Some(from) => eprintln!("watch: connection closed; reconnecting after {from}"),
                    None => eprintln!("watch: connection closed; reconnecting at the end of the log"),
                }
            }
            Ok(r) => eprintln!("watch: the server answered {}; reconnecting", r.status()),
            Err(e) => eprintln!("watch: cannot reach {}: {e}; reconnecting", args.url),
        }
        tokio::select! {
            _ = &mut ctrl_c => return Ok(()),
            _ = tokio::time::sleep(Duration::from_millis(progress.backoff_ms)) => {}
        }
        progress.backoff_ms = (progress.backoff_ms * 2).min(RECONNECT_MAX_MS);
    }
}

/// What a watch carries from one connection to the next.
struct Progress {
    /// The id of the last event received: a reconnect resumes after it (`Last-Event-ID`).
    last: Option<String>,
    /// Events printed, for `--count`.
    printed: u64,
    /// The wait before the next reconnect; back to the first after an event.
    backoff_ms: u64,
}

/// How one connection's stream ended.
enum Connection {
    /// The watch is over: Ctrl-C, `--count` reached, or standard output closed.
    Done,
    /// The connection broke or went silent: reconnect.
    Broken,
}

/// `GET /watch` with the filters; `since` only on the first connection (a reconnect sends
/// `Last-Event-ID` instead).
fn watch_url(args: &WatchArgs, last: Option<&str>) -> Result<url::Url, CliError> {
    let mut query: Vec<(&str, String)> = Vec::new();
    if let Some(t) = &args.types {
        query.push(("types", t.clone()));
    }
    if let Some(t) = &args.tenant {
        query.push(("tenantId", t.clone()));
    }
    if let (None, Some(since)) = (last, &args.since) {
        query.push(("since", since.query()));
    }
    url::Url::parse_with_params(&format!("{}/watch", args.url.trim_end_matches('/')), &query)
        .map_err(|e| CliError::usage(format!("malformed BETTER_COMPUTE_URL: {e}")))
}

/// A 4xx answer (but 408 and 429, which are worth a retry): the server's code and message.
async fn refusal(response: reqwest::Response) -> CliError {
    let status = response.status();
    let body: Value = response.json().await.unwrap_or_default();
    let code = body["code"].as_str().unwrap_or("INVALID_ARGUMENT");
    let message = body["message"].as_str().unwrap_or("refused");
    CliError::new(code, format!("the server refused the watch ({status}): {message}"))
}

/// Reads one connection's event stream, printing each event, until it ends or the watch is over.
async fn print_stream(
    response: reqwest::Response,
    args: &WatchArgs,
    progress: &mut Progress,
    mut ctrl_c: std::pin::Pin<&mut impl std::future::Future<Output = std::io::Result<()>>>,
) -> Result<Connection, CliError> {
    let mut body = response.bytes_stream();
    let mut parser = SseParser::default();
    loop {
        let chunk = tokio::select! {
            _ = &mut ctrl_c => return Ok(Connection::Done),
            c = tokio::time::timeout(Duration::from_secs(IDLE_TIMEOUT_S), body.next()) => c,
        };
        // A half-open connection (silent for longer than heartbeats allow) is broken.
        let Ok(Some(Ok(chunk))) = chunk else { return Ok(Connection::Broken) };
        for event in parser.push(&chunk) {
            // As in the SSE spec, an id counts even on an event without data.
            if let Some(id) = event.id {
                progress.last = Some(id);
            }
            let Some(data) = event.data else { continue };
            if !print_event(data) {
                return Ok(Connection::Done);
            }
            progress.printed += 1;
            progress.backoff_ms = RECONNECT_FIRST_MS;
            if args.count.is_some_and(|c| progress.printed >= c) {
                return Ok(Connection::Done);
            }
        }
        if parser.buffer.len() > LINE_BYTES_MAX {
            return Err(CliError::new("INVALID_RESPONSE", "the watch stream sent a line longer than 1 MiB"));
        }
    }
}

/// Prints one event's data as a JSON line; false when standard output is closed (`| head -1`),
/// which ends the watch quietly.
fn print_event(data: String) -> bool {
    use std::io::Write;
    let value: Value = serde_json::from_str(&data).unwrap_or(Value::String(data));
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", output::safe_json(&value, false)).and_then(|()| out.flush()).is_ok()
}

/// Server-sent events, as far as the watch uses them: `id:` and `data:` lines, an event ended
/// by a blank line. Bytes go in as they arrive; whole events come out.
#[derive(Default)]
struct SseParser {
    /// Bytes of a line not yet ended.
    buffer: Vec<u8>,
    id: Option<String>,
    data: String,
}

/// What a blank line ends: the event's id and its data, when it had them.
struct SseEvent {
    id: Option<String>,
    data: Option<String>,
}

impl SseParser {
    /// Takes the next chunk; returns the events it completes, in order.
    fn push(&mut self, chunk: &[u8]) -> Vec<SseEvent> {
        self.buffer.extend_from_slice(chunk);
        let mut events = Vec::new();
        while let Some(end) = self.buffer.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.buffer.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line[..line.len() - 1]).trim_end_matches('\r').to_owned();
            if line.is_empty() {
                let data = (!self.data.is_empty()).then(|| std::mem::take(&mut self.data));
                events.push(SseEvent { id: self.id.take(), data });
            } else if let Some(v) = line.strip_prefix("id:") {
                self.id = Some(v.trim_start().to_owned());
            } else if let Some(v) = line.strip_prefix("data:") {
                if !self.data.is_empty() {
                    self.data.push('\n');
                }
                self.data.push_str(v.strip_prefix(' ').unwrap_or(v));
            }
        }
        events
    }
}
