//! The one error type of the control plane, with stable codes.
//!
//! The gateway maps [`ErrorCode`] to an HTTP status; the CLI maps it to an exit status. The
//! message is what a person sees; `hint` says what to do next. Internal detail (SQL text, driver
//! errors) stays in `Storage`/`Internal` and is logged, never sent to a client.

use std::fmt;

/// Stable error codes, shared by the API envelope, the CLI and the logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    InvalidArgument,
    NotFound,
    Conflict,
    /// The entity's state does not take this request (a machine's lifecycle verb).
    InvalidState,
    IdempotencyConflict,
    AlreadyExists,
    Unauthenticated,
    AccessDenied,
    QuotaExceeded,
    /// Too many requests from one API key or tenant (its token bucket is empty); retry after
    /// the delay the answer gives.
    RateLimited,
    PayloadTooLarge,
    Unavailable,
    /// A well-formed request this deployment or the target cannot serve (yet): what is
    /// missing is `details.reason`.
    Unsupported,
    /// A call this deployment takes only through a destructive batch under the approvers'
    /// quorum (`dev`/`serve --approvers`): its scope is too wide for one key.
    BatchRequired,
    /// `fleet.apply`: the plan has a change that cannot be made in place; nothing was applied.
    PlanBlocked,
    /// `fleet.apply`: the fleet or the document is not what the reviewed plan was made on;
    /// nothing was applied.
    ConfigDrift,
    Corrupt,
    Internal,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidArgument => "INVALID_ARGUMENT",
            Self::NotFound => "NOT_FOUND",
            Self::Conflict => "CONFLICT",
            Self::InvalidState => "INVALID_STATE",
            Self::IdempotencyConflict => "IDEMPOTENCY_CONFLICT",
            Self::AlreadyExists => "ALREADY_EXISTS",
            Self::Unauthenticated => "UNAUTHENTICATED",
            Self::AccessDenied => "ACCESS_DENIED",
            Self::QuotaExceeded => "QUOTA_EXCEEDED",
            Self::RateLimited => "RATE_LIMITED",
            Self::PayloadTooLarge => "PAYLOAD_TOO_LARGE",
            Self::Unavailable => "UNAVAILABLE",
            Self::Unsupported => "UNSUPPORTED",
            Self::BatchRequired => "BATCH_REQUIRED",
            Self::PlanBlocked => "PLAN_BLOCKED",
            Self::ConfigDrift => "CONFIG_DRIFT",
            Self::Corrupt => "LOG_CORRUPT",
            Self::Internal => "INTERNAL",
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Clone, Debug, thiserror::Error)]
pub enum Error {
    #[error("{message}")]
    InvalidArgument { message: String, hint: Option<String> },
    #[error("{what} not found")]
    NotFound { what: String },
    /// Optimistic concurrency: the stream moved on since the caller read it.
    #[error("stream {stream} is at version {actual}, not {expected}")]
    Conflict { stream: String, expected: String, actual: u64 },
    /// A well-formed request that what it touches does not take now: an archived pool, a
    /// reservation that is not active, a limit the tenant has reached, a lifecycle verb the
    /// entity's state refuses (`allowed` are the verbs it takes now). The same request may succeed
    /// in another state, which is what sets it apart from `InvalidArgument` (wrong in any state).
    #[error("{message}")]
    InvalidState { message: String, allowed: Vec<String>, hint: Option<String> },
    #[error("idempotency key {key:?} was first used for a different request")]
    IdempotencyConflict { key: String },
    #[error("{what} already exists")]
    AlreadyExists { what: String },
    #[error("{0}")]
    Unauthenticated(String),
    #[error("{0}")]
    AccessDenied(String),
    /// A tenant asked for more than its quota allows.
    #[error("{0}")]
    QuotaExceeded(String),
    /// A key's or a tenant's requests came faster than its rate: `retry_after_ms` until the
    /// bucket holds a token again.
    #[error("{message}")]
    RateLimited { message: String, retry_after_ms: u64 },
    #[error("request body exceeds {limit_bytes} bytes")]
    PayloadTooLarge { limit_bytes: usize },
    #[error("{0}")]
    Unavailable(String),
    /// A write whose outcome is unknown: the connection to the database was lost after its
    /// `COMMIT` was sent and before the answer came (the primary died or failed over). It may
    /// or may not have been made; the same request with the same idempotency key finds out
    /// exactly (the first result if it was made, made once if not). Answered `UNAVAILABLE`,
    /// never as a plain failure.
    #[error("{0}")]
    Indeterminate(String),
    /// A request the target cannot serve; `reason` names what is missing, a stable word
    /// (`guest-agent`, `daemon-capability`, …).
    #[error("{message}")]
    Unsupported { message: String, reason: String },
    /// With the approvers' quorum on, a destructive call whose scope needs a batch
    /// (`commandBatches.create`); `hint` says how to make one.
    #[error("{message}")]
    BatchRequired { message: String, hint: String },
    /// A fleet plan with a change that cannot be made in place.
    #[error("{0}")]
    PlanBlocked(String),
    /// A fleet apply whose reviewed plan no longer matches the fleet.
    #[error("{0}")]
    ConfigDrift(String),
    /// The log or a stored row does not verify: corruption or tampering.
    #[error("log corrupt: tenant {tenant} seq {seq}: {what}")]
    Corrupt { tenant: String, seq: u64, what: String },
    #[error("storage error: {0}")]
    Storage(String),
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::InvalidArgument { .. } => ErrorCode::InvalidArgument,
            Self::NotFound { .. } => ErrorCode::NotFound,
            Self::Conflict { .. } => ErrorCode::Conflict,
            Self::InvalidState { .. } => ErrorCode::InvalidState,
            Self::IdempotencyConflict { .. } => ErrorCode::IdempotencyConflict,
            Self::AlreadyExists { .. } => ErrorCode::AlreadyExists,
            Self::Unauthenticated(_) => ErrorCode::Unauthenticated,
            Self::AccessDenied(_) => ErrorCode::AccessDenied,
            Self::QuotaExceeded(_) => ErrorCode::QuotaExceeded,
            Self::RateLimited { .. } => ErrorCode::RateLimited,
            Self::PayloadTooLarge { .. } => ErrorCode::PayloadTooLarge,
            Self::Unavailable(_) | Self::Indeterminate(_) => ErrorCode::Unavailable,
            Self::Unsupported { .. } => ErrorCode::Unsupported,
            Self::BatchRequired { .. } => ErrorCode::BatchRequired,
            Self::PlanBlocked(_) => ErrorCode::PlanBlocked,
            Self::ConfigDrift(_) => ErrorCode::ConfigDrift,
            Self::Corrupt { .. } => ErrorCode::Corrupt,
            Self::Storage(_) | Self::Internal(_) => ErrorCode::Internal,
        }
    }

    /// The message a client may see. Storage and internal detail is replaced.
    pub fn public_message(&self) -> String {
        match self {
            Self::Storage(_) | Self::Internal(_) => "internal error; see the server log".to_owned(),
            other => other.to_string(),
        }
    }

    pub fn hint(&self) -> Option<&str> {
        match self {
            Self::InvalidArgument { hint, .. } | Self::InvalidState { hint, .. } => hint.as_deref(),
            Self::BatchRequired { hint, .. } => Some(hint),
            Self::Conflict { .. } => Some("read the current version and retry"),
            Self::QuotaExceeded(_) => Some(QUOTA_EXCEEDED_HINT),
            Self::RateLimited { .. } => Some("wait the Retry-After delay, then send fewer requests a second"),
            Self::Indeterminate(_) => Some(INDETERMINATE_HINT),
            Self::PlanBlocked(_) => Some("fleet plan names each blocked change and why; change the document"),
            Self::ConfigDrift(_) => Some("run fleet plan again, review it, and apply the new plan's hash"),
            _ => None,
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::InvalidArgument { message: message.into(), hint: None }
    }

    /// [`Error::InvalidState`] with no verbs to name, and what to do instead.
    pub fn state(message: impl Into<String>, hint: impl Into<String>) -> Self {
        Self::InvalidState { message: message.into(), allowed: Vec::new(), hint: Some(hint.into()) }
    }

    pub fn not_found(what: impl Into<String>) -> Self {
        Self::NotFound { what: what.into() }
    }
}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        Self::Storage(e.to_string())
    }
}

/// [`Error::QuotaExceeded`]'s hint. The code covers every counted bound (a pool's GPUs, a
/// quota's instances, vCPUs, memory and sandboxes, a tenant's or a node's sandboxes, tunnels,
/// join requests, snapshots): the message names which, its limit and the use.
pub const QUOTA_EXCEEDED_HINT: &str = "free some of what the message counts (release a reservation, delete an instance or a \
     sandbox, close a tunnel) or ask for less; an operator can raise a quota (quotas set)";

/// [`Error::Indeterminate`]'s hint.
pub const INDETERMINATE_HINT: &str = "the write may or may not have been made: send the same request again with the same \
     Idempotency-Key (it is answered with the first result if it was made, and made once if not)";

/// SQLSTATEs that say the server cannot take this session's work now, not that the work is
/// wrong: class 08 (connection exception), 57P01-57P03 (the server is shutting down, crashed or
/// starting), 53300 (no connection slot), 25006 (a read-only server: a standby, or a primary
/// demoted under the connection). Answered [`Error::Unavailable`]: another try, once the pool
/// has found the primary again, may succeed.
pub fn sqlstate_unavailable(code: &str) -> bool {
    code.starts_with("08") || matches!(code, "57P01" | "57P02" | "57P03" | "53300" | "25006")
}

impl From<tokio_postgres::Error> for Error {
    fn from(e: tokio_postgres::Error) -> Self {
        match e.as_db_error() {
            Some(db) => {
                let text = format!(
                    "{}: {}{}",
                    db.code().code(),
                    db.message(),
                    db.detail().map(|d| format!(" ({d})")).unwrap_or_default()
                );
                if sqlstate_unavailable(db.code().code()) {
                    Self::Unavailable(format!("postgresql: {text}"))
                } else {
                    Self::Storage(text)
                }
            }
            // The connection is gone, or never was (refused, timed out, no read-write server
            // among the URL's hosts): the database is unavailable, the request was not wrong.
            None if e.is_closed() || lost_connection(&e) => Self::Unavailable(format!("postgresql: {e}")),
            None => Self::Storage(e.to_string()),
        }
    }
}

/// Whether a driver error without a SQLSTATE is the connection's: an I/O error, a timeout, or a
/// failed connection attempt (tokio-postgres's `Io`, `Timeout` and `Connect` kinds, told apart by
/// their text as the kind is private).
fn lost_connection(e: &tokio_postgres::Error) -> bool {
    let io = std::iter::successors(std::error::Error::source(e), |c| c.source()).any(|c| c.is::<std::io::Error>());
    let text = e.to_string();
    io || text.starts_with("error connecting to server")
        || text.starts_with("error communicating with the server")
        || text.starts_with("timeout waiting for server")
}

impl From<deadpool_postgres::PoolError> for Error {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        Self::Unavailable(format!("postgresql pool: {e}"))
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
