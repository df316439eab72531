//! The HTTP client of the API: one POST per method, errors decoded from the envelope.

use serde_json::Value;

/// How long one API call may take.
pub const CALL_TIMEOUT_S: u64 = 60;
/// The longest `RATE_LIMITED` delay the client waits out (once) before sending a call again;
/// a longer one fails at once.
pub const RATE_LIMITED_RETRY_S_MAX: u64 = 10;

/// A failure with a stable code; the exit status follows from it.
#[derive(Debug)]
pub struct CliError {
    pub code: String,
    pub message: String,
    pub hint: Option<String>,
    /// A result to print on stdout even though the command failed (`audit verify`'s problems).
    pub details: Option<serde_json::Value>,
    /// The chain of causes under the message, outermost first: printed only with
    /// `BETTER_COMPUTE_DEBUG=1` (they may carry internal detail). A boxed slice, so the error
    /// stays small enough to return by value.
    pub causes: Box<[String]>,
}

impl CliError {
    pub fn new(code: &str, message: impl Into<String>) -> Self {
        Self { code: code.to_owned(), message: message.into(), hint: None, details: None, causes: Box::default() }
    }

    /// Records `cause` and every error under it (`source()`) as this error's causes.
    pub fn caused_by(mut self, cause: &(dyn std::error::Error + 'static)) -> Self {
        let chain = std::iter::successors(Some(cause), |e| e.source()).map(|e| e.to_string());
        self.causes = self.causes.iter().cloned().chain(chain).collect();
        self
    }

    pub fn hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }

    pub fn usage(message: impl Into<String>) -> Self {
        Self::new("INVALID_ARGUMENT", message)
    }

    /// 2 for a usage mistake, 1 for everything else.
    pub fn exit_status(&self) -> u8 {
        match self.code.as_str() {
            "INVALID_ARGUMENT" | "INVALID_COMMAND" => 2,
            // What a monitor exists to find (`audit follow`): stable, apart from any other failure.
            "AUDIT_FORK" | "AUDIT_BAD_ENTRY" => 3,
            // The remote program's own status (`ssh-cert --connect`), 255 when none is known.
            "REMOTE_EXIT" => self
                .details
                .as_ref()
                .and_then(|d| d["exitStatus"].as_u64())
                .and_then(|s| u8::try_from(s).ok())
                .filter(|s| *s != 0)
                .unwrap_or(255),
            _ => 1,
        }
    }
}

impl From<bc_core::Error> for CliError {
    fn from(e: bc_core::Error) -> Self {
        let hint = e.hint().map(str::to_owned);
        let causes = std::iter::successors(std::error::Error::source(&e), |c| c.source()).map(|c| c.to_string()).collect();
        Self { code: e.code().as_str().to_owned(), message: e.to_string(), hint, details: None, causes }
    }
}

pub struct Client {
    http: reqwest::Client,
    url: String,
    token: Option<String>,
}

/// Where the API may be called: `https://` anywhere, plain `http://` only on the loopback names
/// `localhost`, `*.localhost`, `127.0.0.1` and `[::1]`, so a token never crosses a network in clear
/// text. The host is judged as written in the URL, never by what it resolves to (a name pointing
/// at 127.0.0.1 is still refused), and before anything is sent. A URL carrying a user or password
/// is refused too. Returns the parsed URL.
pub fn api_url(url: &str) -> Result<url::Url, CliError> {
    let parsed = url::Url::parse(url).map_err(|e| CliError::usage(format!("malformed BETTER_COMPUTE_URL {url:?}: {e}")))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(CliError::usage(format!("BETTER_COMPUTE_URL must be http:// or https://, not {url:?}")));
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        // Never echo it: it carries a credential.
        return Err(CliError::usage(
            "the URL must not carry a user or password; tokens go in BETTER_COMPUTE_TOKEN or auth login",
        ));
    }
    if parsed.scheme() == "http" && !is_loopback_host(&parsed) {
        let host = parsed.host_str().unwrap_or_default();
        return Err(CliError::usage(format!(
            "plain http is only for loopback (localhost, *.localhost, 127.0.0.1, [::1]), not {host:?}: a token must not cross a network in clear text"
        ))
        .hint(format!("use https://{}", parsed.as_str().trim_start_matches("http://"))));
    }
    Ok(parsed)
}

/// The host as written is one of the loopback names plain `http` is allowed for.
fn is_loopback_host(url: &url::Url) -> bool {
    match url.host() {
        Some(url::Host::Domain(name)) => {
            let name = name.to_ascii_lowercase();
            name == "localhost" || name.ends_with(".localhost")
        }
        Some(url::Host::Ipv4(ip)) => ip == std::net::Ipv4Addr::LOCALHOST,
        Some(url::Host::Ipv6(ip)) => ip == std::net::Ipv6Addr::LOCALHOST,
        None => false,
    }
}

/// The HTTP client every call to the API uses (the calls and the watch): it follows no
/// redirect, so a 30x never carries the token to another address, and for plain `http` (loopback
/// only, see [`api_url`]) it uses no proxy, so the token never travels in clear text to one.
pub fn api_http(url: &url::Url, builder: reqwest::ClientBuilder) -> Result<reqwest::Client, CliError> {
    // The gateway closes an HTTP/1.1 connection that waits longer than its header-read timeout
    // for the next request: an idle connection is dropped here first, so a request is never
    // sent on one the server is closing at that moment (a POST is not retried).
    let idle = std::time::Duration::from_secs(bc_gateway::conn::HEADER_READ_TIMEOUT_S / 2);
    let mut builder = builder.redirect(reqwest::redirect::Policy::none()).pool_idle_timeout(idle);
    if url.scheme() == "http" {
        builder = builder.no_proxy();
        // A `*.localhost` name is loopback by definition (RFC 6761), but a resolver without that
        // rule may send it to DNS: pin it to loopback, so the clear-text token stays local.
        if let Some(url::Host::Domain(name)) = url.host()
            && name.to_ascii_lowercase().ends_with(".localhost")
        {
            let port = url.port_or_known_default().unwrap_or(80);
            let loopback = [
                std::net::SocketAddr::from(([127, 0, 0, 1], port)),
                std::net::SocketAddr::from(([0u16, 0, 0, 0, 0, 0, 0, 1], port)),
            ];
            builder = builder.resolve_to_addrs(name, &loopback);
        }
    }
    builder.build().map_err(|e| CliError::new("INTERNAL", format!("building the HTTP client: {e}")))
}

/// The error for a 30x answer: the client never follows one, and says where it pointed.
pub fn redirect_refused(status: reqwest::StatusCode, location: Option<&reqwest::header::HeaderValue>) -> CliError {
    let to = location.and_then(|l| l.to_str().ok()).map(|l| format!(" to {l:?}")).unwrap_or_default();
    CliError::new("INVALID_RESPONSE", format!("the server answered {status} (a redirect{to}); the client follows no redirects"))
        .hint("set BETTER_COMPUTE_URL (or --url) to the API's own address")
}

impl Client {
    pub fn new(url: &str, token: Option<String>) -> Result<Self, CliError> {
        let parsed = api_url(url)?;
        let http = api_http(&parsed, reqwest::Client::builder().timeout(std::time::Duration::from_secs(CALL_TIMEOUT_S)))?;
        Ok(Self { http, url: url.trim_end_matches('/').to_owned(), token })
    }

    /// One call, with a request id of its own (`X-Request-Id`, the events' correlation). A call
    /// refused `RATE_LIMITED` with a delay of at most [`RATE_LIMITED_RETRY_S_MAX`] is sent once
    /// more after it, with the same request id and idempotency key.
    pub async fn call(&self, method: &str, body: &Value, idempotency_key: Option<&str>) -> Result<Value, CliError> {
        let request_id = bc_core::id::RequestId::generate().to_string();
        match self.call_once(method, body, idempotency_key, &request_id).await {
            Err(e) if e.code == "RATE_LIMITED" => {
                let wait_ms = e.details.as_ref().and_then(|d| d["retryAfterMs"].as_u64()).unwrap_or(u64::MAX);
                if wait_ms > RATE_LIMITED_RETRY_S_MAX * 1000 {
                    return Err(e);
                }
                eprintln!("{}: {} (retrying once in {} ms)", e.code, e.message, wait_ms);
                tokio::time::sleep(std::time::Duration::from_millis(wait_ms)).await;
                self.call_once(method, body, idempotency_key, &request_id).await
            }
            other => other,
        }
    }

    async fn call_once(
        &self,
        method: &str,
        body: &Value,
        idempotency_key: Option<&str>,
        request_id: &str,
    ) -> Result<Value, CliError> {
        let mut request =
            self.http.post(format!("{}/api/compute/{method}", self.url)).json(body).header("x-request-id", request_id);
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        if let Some(key) = idempotency_key {
            request = request.header("idempotency-key", key);
        }
        let response = request.send().await.map_err(|e| {
            CliError::new("UNAVAILABLE", format!("cannot reach {}: {e}", self.url))
                .hint("start the server with `make dev`, or set BETTER_COMPUTE_URL")
                .caused_by(&e)
        })?;
        let status = response.status();
        // `Retry-After` in whole seconds, when the body gives no finer delay.
        let retry_after_s =
            response.headers().get(reqwest::header::RETRY_AFTER).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if status.is_redirection() {
            return Err(redirect_refused(status, response.headers().get(reqwest::header::LOCATION)));
        }
        let text = response.text().await.map_err(|e| CliError::new("UNAVAILABLE", format!("reading the response: {e}")))?;
        let value: Value = serde_json::from_str(&text).map_err(|_| {
            CliError::new("INVALID_RESPONSE", format!("the server answered {status} with a body that is not JSON"))
        })?;
        if status.is_success() {
            return Ok(value);
        }
        let code = value["code"].as_str().unwrap_or("INTERNAL").to_owned();
        let message = value["message"].as_str().unwrap_or("request failed").to_owned();
        let mut error = CliError::new(&code, message);
        if code == "RATE_LIMITED" {
            let ms = value["details"]["retryAfterMs"].as_u64().or(retry_after_s.map(|s| s.saturating_mul(1000)));
            error.details = ms.map(|ms| serde_json::json!({ "retryAfterMs": ms }));
        }
        error.hint = value["details"]["hint"].as_str().map(str::to_owned).or_else(|| match code.as_str() {
            "UNAUTHENTICATED" => Some("check BETTER_COMPUTE_TOKEN (dev writes one to .better-compute/admin.token)".into()),
            _ => value["details"]["didYouMean"].as_str().map(|m| format!("did you mean {m}?")),
        });
        Err(error)
    }
}

#[cfg(test)]
mod tests {
    use super::api_url;

    #[test]
    fn plain_http_only_on_the_loopback_names_as_written() {
        for allowed in [
            "http://localhost:7070",
            "http://LOCALHOST:7070/",
            "http://compute.localhost:7070",
            "http://127.0.0.1:7070",
            "http://[::1]:7070",
            "https://compute.example.com",
            "https://10.0.0.8:8443",
        ] {
            assert!(api_url(allowed).is_ok(), "{allowed} is allowed");
        }
        for refused in [
            "http://notlocal.test:8089",
            "http://127.0.0.2:7070",
            "http://10.0.0.8:7070",
            "http://localhost.example.com:7070",
            "http://notlocalhost:7070",
            "http://[::2]:7070",
            "http://0.0.0.0:7070",
        ] {
            let e = api_url(refused).err().unwrap_or_else(|| panic!("{refused} is refused"));
            assert_eq!(e.code, "INVALID_ARGUMENT", "{refused}");
            assert_eq!(e.exit_status(), 2, "{refused}");
            assert!(e.message.contains("plain http is only for loopback"), "{refused}: {}", e.message);
        }
    }
}
