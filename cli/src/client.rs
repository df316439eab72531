//! The HTTP client of the API: one POST per method, errors decoded from the envelope.

use serde_json::Value;

/// How long one API call may take.
pub const CALL_TIMEOUT_S: u64 = 60;

/// A failure with a stable code; the exit status follows from it.
#[derive(Debug)]
pub struct CliError {
    pub code: String,
    pub message: String,
    pub hint: Option<String>,
    /// A result to print on stdout even though the command failed (`audit verify`'s problems).
    pub details: Option<serde_json::Value>,
}

impl CliError {
    pub fn new(code: &str, message: impl Into<String>) -> Self {
        Self { code: code.to_owned(), message: message.into(), hint: None, details: None }
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
        if matches!(self.code.as_str(), "INVALID_ARGUMENT" | "INVALID_COMMAND") { 2 } else { 1 }
    }
}

impl From<bc_core::Error> for CliError {
    fn from(e: bc_core::Error) -> Self {
        let hint = e.hint().map(str::to_owned);
        Self { code: e.code().as_str().to_owned(), message: e.to_string(), hint, details: None }
    }
}

pub struct Client {
    http: reqwest::Client,
    url: String,
    token: Option<String>,
}

impl Client {
    pub fn new(url: &str, token: Option<String>) -> Result<Self, CliError> {
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
        let http = reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(CALL_TIMEOUT_S))
            .build()
            .map_err(|e| CliError::new("INTERNAL", format!("building the HTTP client: {e}")))?;
        Ok(Self { http, url: url.trim_end_matches('/').to_owned(), token })
    }

    pub async fn call(&self, method: &str, body: &Value, idempotency_key: Option<&str>) -> Result<Value, CliError> {
        let mut request = self.http.post(format!("{}/api/compute/{method}", self.url)).json(body);
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        if let Some(key) = idempotency_key {
            request = request.header("idempotency-key", key);
        }
        let response = request.send().await.map_err(|e| {
            CliError::new("UNAVAILABLE", format!("cannot reach {}: {e}", self.url))
                .hint("start the server with `make dev`, or set BETTER_COMPUTE_URL")
        })?;
        let status = response.status();
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
        error.hint = value["details"]["hint"].as_str().map(str::to_owned).or_else(|| match code.as_str() {
            "UNAUTHENTICATED" => Some("check BETTER_COMPUTE_TOKEN (dev writes one to .better-compute/admin.token)".into()),
            _ => value["details"]["didYouMean"].as_str().map(|m| format!("did you mean {m}?")),
        });
        Err(error)
    }
}
