//! The production backend: PostgreSQL through `tokio-postgres` and `deadpool-postgres`.
//!
//! Only SQL text, parameter binding and row decoding live here; the algorithms (append commit,
//! locked commit, projection fold, migrations, the outbox's transactions) are in `engine.rs` and
//! `outbox.rs`, over [`PostgresTransaction`].
//!
//! Batches are written with `UNNEST` over arrays, one statement per table. The append
//! transaction updates the one-row `log_counter` first; its row lock (not an advisory lock)
//! serialises append transactions across processes, so commit numbers follow commit order and a
//! reader by position never skips an event that committed late. Everything else is guarded by
//! primary keys and unique constraints; claims and pruning take rows with `FOR UPDATE SKIP
//! LOCKED`, so processes never wait on each other's rows.

use std::collections::HashMap;
use std::str::FromStr;

use async_trait::async_trait;
use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod};
use tokio_postgres::{Client, NoTls};

pub use tls::{TlsMode, TlsOptions};

use super::engine::{Migration, Transaction};
use super::outbox::{
    ATTEMPT_COLUMNS, Attempt, CLAIM_ITEMS_MAX, Completion, ITEM_COLUMNS, NewWorkItem, OutboxStore, WorkItem, WorkState,
    count_states, outcome_columns,
};
use super::status::{PASS_COLUMNS, PassRecord, StatusStore};
use super::{
    EventStore, Head, LogStore, PreRead, PreReadQuery, PreparedBatch, RawRow, Row, RowKey, RowStore, SecretStore, Store,
    WriteToken, columns_by_try_get, event_row_decode, head_decode, idempotency_decode, migrations_of, projection_row_decode,
    raw_row_decode, stream_version_decode, to_i64, to_u32, to_u64,
};
use crate::error::{Error, Result};
use crate::event::{EventRow, Position};
use crate::id::{EventId, TenantId};

/// Connections per process, so a burst cannot exhaust the server's connection slots.
pub const POOL_CONNECTIONS_MAX: usize = 16;
/// Projection rows per statement when a rebuild swaps them all in.
const ROWS_PER_STATEMENT_MAX: usize = 10_000;

const MIGRATIONS: &[Migration] = migrations_of!("postgres");

/// [`EVENT_COLUMNS`](super::EVENT_COLUMNS) with `commit_index` (an `int4`) widened for the shared
/// decoder, under another name: an output column named `commit_index` would be what `ORDER BY
/// commit_index` sorts by, an expression no index orders (regression: every read by position
/// sorted its rows).
const EVENT_COLUMNS: &str =
    "tenant_id, seq, id, stream, version, type, commit_no, commit_index::int8 AS commit_index_wide, canonical, hash, sig, key_id";

/// A chain's rows from seq `$2`, at most `$3 - $2` of them, in seq order. Read as the range
/// `[$2, $3)` first, and past it only when the range holds fewer rows (the chain ends in it, or a
/// tampered chain has a gap): the plain `seq >= $2 ORDER BY seq LIMIT n` was planned, while the
/// table's statistics were stale (a log loaded faster than autovacuum analyzes it), as a bitmap
/// scan of every row from `$2` to the chain's end and a sort, so an audit's walk read the rest of
/// the chain for each page (39 ms a page in the middle of 200,000 events, against 1.3 ms so).
/// The range's row count is a one-time filter: a full range never scans past it.
fn read_chain_rows_sql() -> String {
    format!(
        "WITH r AS MATERIALIZED (SELECT {EVENT_COLUMNS} FROM events WHERE tenant_id = $1 AND seq >= $2 AND seq < $3) \
         SELECT * FROM r \
         UNION ALL (SELECT {EVENT_COLUMNS} FROM events \
                    WHERE tenant_id = $1 AND seq >= $3 AND (SELECT count(*) FROM r) < $3 - $2 ORDER BY seq LIMIT $3 - $2) \
         ORDER BY seq LIMIT $3 - $2"
    )
}

/// A page of one kind's projection rows after a cursor, in byte order (as on SQLite). The keys'
/// columns are in the "C" collation (migration 0008), so the primary key walks them in this
/// order (`plan_tests`).
const ROW_LIST_SQL: &str = "SELECT tenant_id, kind, id, doc FROM projections \
     WHERE tenant_id = $1 AND kind = $2 AND id COLLATE \"C\" > $3 ORDER BY id COLLATE \"C\" LIMIT $4";
/// [`RowStore::row_last`]: the primary key (in "C", migration 0008) walked backwards.
const ROW_LAST_SQL: &str = "SELECT tenant_id, kind, id, doc FROM projections \
     WHERE tenant_id = $1 AND kind = $2 ORDER BY id COLLATE \"C\" DESC LIMIT 1";

pub struct PostgresStore {
    pool: Pool,
    data_keys: std::sync::RwLock<Option<std::sync::Arc<crate::sealing::DataKeys>>>,
}

impl PostgresStore {
    /// Connects to `postgres://…` (checking the connection once, so a wrong URL fails here),
    /// secured as its `sslmode` says (`disable`, `prefer` (the default, as libpq's), `require`,
    /// `verify-full` with `sslrootcert=PEM_FILE` or the system's roots): see [`tls`].
    pub async fn connect(url: &str) -> Result<Self> {
        let options = TlsOptions::from_url(url)?;
        let mut config = tokio_postgres::Config::from_str(&options.url).map_err(|e| Error::InvalidArgument {
            message: format!("malformed database URL: {e}"),
            hint: Some("expected postgres://USER@HOST:PORT/DATABASE".into()),
        })?;
        // Statements prepared once per connection ([`cached`]) are still planned for each
        // call's own values, as a statement sent as text is: a plan made once for any values
        // (PostgreSQL's choice after five calls) misjudged the batch's arrays.
        let custom = "-c plan_cache_mode=force_custom_plan";
        let options_now = config.get_options().map(|o| format!("{o} {custom}")).unwrap_or_else(|| custom.to_owned());
        config.options(options_now);
        liveness_defaults(&mut config, &options.url);
        let recycling = ManagerConfig { recycling_method: RecyclingMethod::Fast };
        let manager = match options.connector()? {
            None => Manager::from_config(config, NoTls, recycling),
            Some(tls) => Manager::from_config(config, tls, recycling),
        };
        let pool = Pool::builder(manager)
            .max_size(POOL_CONNECTIONS_MAX)
            .build()
            .map_err(|e| Error::Internal(format!("building the pool: {e}")))?;
        let client = pool.get().await.map_err(|e| {
            Error::Unavailable(format!(
                "cannot connect to PostgreSQL: {e}; hint: check --database-url and that the server is running"
            ))
        })?;
        drop(client);
        Ok(Self { pool, data_keys: Default::default() })
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }
}

/// Waits on a dead or partitioned server bounded unless the URL says otherwise (libpq's keys):
/// `connect_timeout` 5 s a host, so a URL of several hosts (`postgres://u@h1:5432,h2:5432/db?
/// target_session_attrs=read-write`) moves on from a dead one to the primary; TCP keepalives
/// from 10 s of silence, every 5 s, 3 unanswered closing the connection, so a pooled connection
/// to a machine that vanished is dropped in about 25 s rather than the kernel's 2 hours; the
/// pool then connects anew, to whichever host is the primary now. The URL's own values win.
fn liveness_defaults(config: &mut tokio_postgres::Config, url: &str) {
    let query = url.split_once('?').map(|(_, q)| q).unwrap_or("");
    let given = |key: &str| query.split('&').any(|pair| pair.split_once('=').map(|(k, _)| k).unwrap_or(pair) == key);
    if !given("connect_timeout") {
        config.connect_timeout(std::time::Duration::from_secs(CONNECT_TIMEOUT_S));
    }
    if !given("keepalives_idle") {
        config.keepalives_idle(std::time::Duration::from_secs(KEEPALIVE_IDLE_S));
    }
    if !given("keepalives_interval") {
        config.keepalives_interval(std::time::Duration::from_secs(KEEPALIVE_INTERVAL_S));
    }
    if !given("keepalives_retries") {
        config.keepalives_retries(KEEPALIVE_RETRIES);
    }
}

/// [`liveness_defaults`]: seconds a connection attempt to one host may take.
pub const CONNECT_TIMEOUT_S: u64 = 5;
/// [`liveness_defaults`]: seconds of silence before the first keepalive probe.
pub const KEEPALIVE_IDLE_S: u64 = 10;
/// [`liveness_defaults`]: seconds between keepalive probes.
pub const KEEPALIVE_INTERVAL_S: u64 = 5;
/// [`liveness_defaults`]: unanswered probes that close the connection.
pub const KEEPALIVE_RETRIES: u32 = 3;

pub mod tls {
    //! TLS to PostgreSQL with rustls (ring). tokio-postgres knows `sslmode` `disable`, `prefer`
    //! and `require` only, and no `sslrootcert`: both are taken out of the URL here and the
    //! connector is built to match libpq's meaning:
    //!
    //! - `disable`: plain TCP;
    //! - `prefer` (the default): TLS when the server offers it, without checking its
    //!   certificate (as libpq), plain otherwise;
    //! - `require`: TLS or no connection, the certificate not checked (as libpq without a root
    //!   certificate);
    //! - `verify-full`: TLS, the certificate checked against `sslrootcert` (a PEM file of CA
    //!   certificates) or, without it, the system's roots, and the host name checked against it.
    //!
    //! `verify-ca` (a chain checked without the host name) is refused with a hint to use
    //! `verify-full`: a half-check is not offered.

    use std::path::PathBuf;
    use std::sync::Arc;

    use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

    use crate::{Error, Result};

    /// How the connection is secured (libpq's `sslmode`).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum TlsMode {
        Disable,
        Prefer,
        Require,
        VerifyFull,
    }

    /// A database URL's TLS options, and the URL tokio-postgres is given.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct TlsOptions {
        pub mode: TlsMode,
        pub root_cert: Option<PathBuf>,
        /// The URL without `sslrootcert`, with an `sslmode` tokio-postgres knows.
        pub url: String,
    }

    impl TlsOptions {
        /// Reads `sslmode` and `sslrootcert` from `url`'s query. Messages never repeat the URL
        /// (it may carry a password).
        pub fn from_url(url: &str) -> Result<Self> {
            let (base, query) = url.split_once('?').unwrap_or((url, ""));
            let mut mode = TlsMode::Prefer;
            let mut root_cert = None;
            let mut kept = Vec::new();
            for pair in query.split('&').filter(|p| !p.is_empty()) {
                let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
                match key {
                    "sslmode" => {
                        mode = match value {
                            "disable" => TlsMode::Disable,
                            // `allow` (plain first) is taken as `prefer`: TLS first.
                            "prefer" | "allow" => TlsMode::Prefer,
                            "require" => TlsMode::Require,
                            "verify-full" => TlsMode::VerifyFull,
                            "verify-ca" => {
                                return Err(Error::InvalidArgument {
                                    message: "sslmode=verify-ca is not supported".into(),
                                    hint: Some("use sslmode=verify-full (the chain and the host name are checked)".into()),
                                });
                            }
                            other => {
                                return Err(Error::InvalidArgument {
                                    message: format!(
                                        "sslmode={:?} is not one of disable, prefer, require, verify-full",
                                        crate::id::truncate(other, 20)
                                    ),
                                    hint: None,
                                });
                            }
                        }
                    }
                    "sslrootcert" => root_cert = Some(PathBuf::from(percent_decode(value))),
                    _ => kept.push(pair),
                }
            }
            // What tokio-postgres is told: it verifies nothing itself (the connector does).
            kept.push(match mode {
                TlsMode::Disable => "sslmode=disable",
                TlsMode::Prefer => "sslmode=prefer",
                TlsMode::Require | TlsMode::VerifyFull => "sslmode=require",
            });
            Ok(Self { mode, root_cert, url: format!("{base}?{}", kept.join("&")) })
        }

        /// The connector for the mode: `None` for `disable`.
        pub fn connector(&self) -> Result<Option<tokio_postgres_rustls::MakeRustlsConnect>> {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let builder = ClientConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .map_err(|e| Error::Internal(format!("TLS versions: {e}")))?;
            let config = match self.mode {
                TlsMode::Disable => return Ok(None),
                TlsMode::Prefer | TlsMode::Require => {
                    builder.dangerous().with_custom_certificate_verifier(Arc::new(Unverified(provider))).with_no_client_auth()
                }
                TlsMode::VerifyFull => builder.with_root_certificates(self.roots()?).with_no_client_auth(),
            };
            Ok(Some(tokio_postgres_rustls::MakeRustlsConnect::new(config)))
        }

        fn roots(&self) -> Result<RootCertStore> {
            let mut roots = RootCertStore::empty();
            match &self.root_cert {
                Some(path) => {
                    let unreadable = |e: String| Error::InvalidArgument {
                        message: format!("sslrootcert {}: {e}", path.display()),
                        hint: Some("give a PEM file of the CA certificates that sign the server's".into()),
                    };
                    let certs = CertificateDer::pem_file_iter(path)
                        .map_err(|e| unreadable(e.to_string()))?
                        .collect::<std::result::Result<Vec<_>, _>>()
                        .map_err(|e| unreadable(e.to_string()))?;
                    let (added, _) = roots.add_parsable_certificates(certs);
                    if added == 0 {
                        return Err(unreadable("no certificate in it".into()));
                    }
                }
                None => {
                    let found = rustls_native_certs::load_native_certs();
                    roots.add_parsable_certificates(found.certs);
                    if roots.is_empty() {
                        return Err(Error::InvalidArgument {
                            message: "sslmode=verify-full: no sslrootcert and no system root certificates".into(),
                            hint: Some("add sslrootcert=PATH (a PEM file of CA certificates) to the URL".into()),
                        });
                    }
                }
            }
            Ok(roots)
        }
    }

    /// `%XX` decoded (a path in a URL's query).
    fn percent_decode(text: &str) -> String {
        let bytes = text.as_bytes();
        let mut out = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == b'%'
                && let Some(byte) = text.get(i + 1..i + 3).and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                out.push(byte);
                i += 3;
                continue;
            }
            out.push(bytes[i]);
            i += 1;
        }
        String::from_utf8_lossy(&out).into_owned()
    }

    /// `prefer` and `require`: the certificate is not checked (libpq's meaning of those modes),
    /// but the handshake's signatures are, so the session is still encrypted to whoever holds
    /// the certificate's key.
    #[derive(Debug)]
    struct Unverified(Arc<rustls::crypto::CryptoProvider>);

    impl ServerCertVerifier for Unverified {
        fn verify_server_cert(
            &self,
            _end_entity: &CertificateDer<'_>,
            _intermediates: &[CertificateDer<'_>],
            _server_name: &ServerName<'_>,
            _ocsp_response: &[u8],
            _now: UnixTime,
        ) -> std::result::Result<ServerCertVerified, rustls::Error> {
            Ok(ServerCertVerified::assertion())
        }

        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.0.signature_verification_algorithms.supported_schemes()
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn sslmode_and_sslrootcert_are_read_and_the_driver_gets_what_it_knows() {
            let o = TlsOptions::from_url("postgres://u@h:5432/db").unwrap();
            assert_eq!((o.mode, o.url.as_str()), (TlsMode::Prefer, "postgres://u@h:5432/db?sslmode=prefer"));
            let o = TlsOptions::from_url("postgres://u@h/db?application_name=x&sslmode=verify-full&sslrootcert=%2Ftmp%2Fca.pem")
                .unwrap();
            assert_eq!(o.mode, TlsMode::VerifyFull);
            assert_eq!(o.root_cert.as_deref(), Some(std::path::Path::new("/tmp/ca.pem")));
            assert_eq!(o.url, "postgres://u@h/db?application_name=x&sslmode=require");
            assert_eq!(TlsOptions::from_url("postgres://h/db?sslmode=disable").unwrap().mode, TlsMode::Disable);
            let refused = TlsOptions::from_url("postgres://h/db?sslmode=verify-ca").unwrap_err();
            assert!(matches!(refused, Error::InvalidArgument { hint: Some(h), .. } if h.contains("verify-full")));
            assert!(
                TlsOptions::from_url("postgres://p:secret@h/db?sslmode=bogus").unwrap_err().to_string().find("secret").is_none()
            );
        }
    }
}

/// The columns of `keys`, as the three arrays an `UNNEST` takes.
fn row_key_arrays(keys: &[RowKey]) -> (Vec<&str>, Vec<&str>, Vec<&str>) {
    (
        keys.iter().map(|k| k.tenant.as_str()).collect(),
        keys.iter().map(|k| k.kind.as_str()).collect(),
        keys.iter().map(|k| k.id.as_str()).collect(),
    )
}

/// `sql` prepared on `client`'s connection once and then taken from its cache: a statement given
/// as text is parsed and planned by the server on every call, a round trip of its own before the
/// one that runs it (measured: a single append's pre-read on PostgreSQL 1,151–1,206 → 415–527 µs,
/// its commit 2,269–3,382 → 1,443–1,750 µs). For fixed texts only: each text is kept for the
/// connection's life.
async fn cached(client: &deadpool_postgres::ClientWrapper, sql: &str) -> Result<tokio_postgres::Statement> {
    Ok(client.prepare_cached(sql).await?)
}

async fn heads_on(
    client: &deadpool_postgres::ClientWrapper,
    tenants: &[TenantId],
    lock: &str,
) -> Result<HashMap<TenantId, Head>> {
    let tenants: Vec<String> = tenants.iter().map(|t| t.to_string()).collect();
    let statement =
        cached(client, &format!("SELECT tenant_id, seq, hash FROM chain_heads WHERE tenant_id = ANY($1){lock}")).await?;
    let rows = client.query(&statement, &[&tenants]).await?;
    rows.iter().map(head_decode).collect()
}

async fn preread_on(client: &deadpool_postgres::ClientWrapper, query: &PreReadQuery) -> Result<PreRead> {
    let (st, ss): (Vec<String>, Vec<&str>) = query.streams.iter().map(|(t, s)| (t.to_string(), s.as_str())).unzip();
    let (it, ik): (Vec<String>, Vec<&str>) = query.idempotency_keys.iter().map(|(t, k)| (t.to_string(), k.as_str())).unzip();
    // A correlated MAX per key walks the (tenant_id, stream, version) index, whatever the
    // planner guesses about UNNEST's size.
    let versions = async {
        if st.is_empty() {
            return Ok(Vec::new());
        }
        let statement = cached(
            client,
            "SELECT k.t, k.s, (SELECT MAX(e.version) FROM events e WHERE e.tenant_id = k.t AND e.stream = k.s)
             FROM UNNEST($1::text[], $2::text[]) AS k(t, s)",
        )
        .await?;
        Ok::<_, Error>(client.query(&statement, &[&st, &ss]).await?)
    };
    let records = async {
        if it.is_empty() {
            return Ok(Vec::new());
        }
        let statement = cached(
            client,
            "SELECT i.tenant_id, i.key, i.request_hash, i.first_seq, i.last_seq
             FROM UNNEST($1::text[], $2::text[]) AS k(t, k)
             CROSS JOIN LATERAL (SELECT * FROM idempotency i WHERE i.tenant_id = k.t AND i.key = k.k) i",
        )
        .await?;
        Ok::<_, Error>(client.query(&statement, &[&it, &ik]).await?)
    };
    // The three reads do not depend on each other: issued together, tokio-postgres pipelines
    // them over the connection, one round trip where they took three (in a transaction they
    // still run in order, in it).
    let (heads, versions, records) = futures::try_join!(heads_on(client, &query.tenants, ""), versions, records)?;
    let mut out = PreRead { heads, ..Default::default() };
    for row in versions {
        if let Some((stream, version)) = stream_version_decode(&row)? {
            out.stream_versions.insert(stream, version);
        }
    }
    for row in records {
        let (slot, record) = idempotency_decode(&row)?;
        out.idempotency.insert(slot, record);
    }
    Ok(out)
}

/// One write transaction on a pooled connection. It owns the connection (so it can be boxed
/// for the engine), issuing `BEGIN`, `COMMIT` and `ROLLBACK` itself; dropped unfinished (a
/// cancelled caller), it detaches the connection from the pool and closes it, which ends the
/// transaction on the server, rather than hand an open transaction to the next caller.
pub struct PostgresTransaction {
    client: Option<Object>,
}

impl PostgresTransaction {
    async fn begin(client: Object) -> Result<Self> {
        // Owned first, so that a caller cancelled while `BEGIN` is in flight drops the
        // connection instead of returning it to the pool inside a transaction.
        let tx = Self { client: Some(client) };
        tx.client()?.batch_execute("BEGIN").await?;
        Ok(tx)
    }

    fn client(&self) -> Result<&Client> {
        self.wrapper().map(|c| &**c)
    }

    /// The connection with its cache of prepared statements.
    fn wrapper(&self) -> Result<&deadpool_postgres::ClientWrapper> {
        self.client.as_deref().ok_or_else(|| Error::Internal("the transaction has already ended".into()))
    }

    /// `sql` prepared on this connection once, and then taken from its cache ([`cached`]).
    async fn cached(&self, sql: &str) -> Result<tokio_postgres::Statement> {
        cached(self.wrapper()?, sql).await
    }

    /// Sends `COMMIT` or `ROLLBACK`; a connection that fails it is not returned to the pool.
    ///
    /// A `COMMIT` whose answer is lost with the connection (the primary died or was demoted while
    /// it ran, or after it ran and before its answer came) may have committed: that is
    /// [`Error::Indeterminate`], never a plain failure. Every error before the `COMMIT` was
    /// sent is definite: a server that loses a connection inside a transaction rolls it back.
    async fn end(&mut self, statement: &str) -> Result<()> {
        let client = self.client.take().ok_or_else(|| Error::Internal("the transaction has already ended".into()))?;
        match client.batch_execute(statement).await {
            Ok(()) => Ok(()),
            Err(e) => {
                drop(Object::take(client));
                Err(commit_error(statement, e.into()))
            }
        }
    }
}

/// The error of a failed `statement` (`COMMIT` or `ROLLBACK`): a `COMMIT` that failed because
/// the database became unavailable (the connection lost, the server shutting down) is
/// [`Error::Indeterminate`]; a refusal with a SQLSTATE of its own (a constraint checked at
/// commit) is definite, as is every `ROLLBACK`'s.
fn commit_error(statement: &str, error: Error) -> Error {
    match error {
        Error::Unavailable(cause) if statement == "COMMIT" => Error::Indeterminate(format!(
            "the database connection was lost while the write was committing ({cause}); it may or may not have been made"
        )),
        other => other,
    }
}

impl Drop for PostgresTransaction {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            drop(Object::take(client));
        }
    }
}

#[async_trait]
impl Transaction for PostgresTransaction {
    async fn commit(&mut self) -> Result<()> {
        self.end("COMMIT").await
    }

    async fn rollback(&mut self) -> Result<()> {
        self.end("ROLLBACK").await
    }

    async fn counter_bump(&mut self) -> Result<u64> {
        let statement =
            self.cached("UPDATE log_counter SET last_commit = last_commit + 1 WHERE id = 1 RETURNING last_commit").await?;
        let row = self.client()?.query_one(&statement, &[]).await?;
        to_u64(row.try_get(0)?)
    }

    async fn counter_lock(&mut self) -> Result<u64> {
        let row = self.client()?.query_one("SELECT last_commit FROM log_counter WHERE id = 1 FOR UPDATE", &[]).await?;
        to_u64(row.try_get(0)?)
    }

    async fn heads_lock(&mut self, tenants: &[TenantId]) -> Result<HashMap<TenantId, Head>> {
        heads_on(self.wrapper()?, tenants, " FOR UPDATE").await
    }

    async fn preread(&mut self, query: &PreReadQuery) -> Result<PreRead> {
        preread_on(self.wrapper()?, query).await
    }

    async fn batch_insert(
        &mut self,
        batch: &PreparedBatch,
        commit: u64,
        touched: &[RowKey],
    ) -> Result<HashMap<RowKey, serde_json::Value>> {
        let tx = self.client()?;
        // Each statement from the connection's cache ([`cached`]), taken before the pipelined
        // calls below (a prepare of its own only on the connection's first batch).
        let events_insert_statement = self.cached("INSERT INTO events (tenant_id, seq, id, stream, version, type, at_ms, commit_no, commit_index, canonical, hash, sig, key_id)
                 SELECT t, s, i, st, v, ty, a, $8, ix, c, h, sg, k
                 FROM UNNEST($1::text[], $2::int8[], $3::text[], $4::text[], $5::int8[], $6::text[], $7::int8[],
                             $9::int4[], $10::bytea[], $11::bytea[], $12::bytea[], $13::text[])
                      AS x(t, s, i, st, v, ty, a, ix, c, h, sg, k)").await?;
        let heads_upsert_statement = self
            .cached(
                "INSERT INTO chain_heads (tenant_id, seq, hash) SELECT * FROM UNNEST($1::text[], $2::int8[], $3::bytea[])
                 ON CONFLICT (tenant_id) DO UPDATE SET seq = excluded.seq, hash = excluded.hash",
            )
            .await?;
        let idempotency_insert_statement = self
            .cached(
                "INSERT INTO idempotency (tenant_id, key, request_hash, first_seq, last_seq)
                 SELECT * FROM UNNEST($1::text[], $2::text[], $3::bytea[], $4::int8[], $5::int8[])",
            )
            .await?;
        let projections_select_statement = self
            .cached(
                "SELECT p.tenant_id, p.kind, p.id, p.doc
                 FROM UNNEST($1::text[], $2::text[], $3::text[]) AS k(t, kd, i)
                 CROSS JOIN LATERAL (SELECT * FROM projections p WHERE p.tenant_id = k.t AND p.kind = k.kd AND p.id = k.i) p",
            )
            .await?;
        let commit = to_i64(commit)?;
        // One array per column, for UNNEST.
        let events = &batch.events;
        let t: Vec<String> = events.iter().map(|e| e.envelope.tenant.to_string()).collect();
        let seq: Vec<i64> = events.iter().map(|e| to_i64(e.envelope.seq)).collect::<Result<_>>()?;
        let id: Vec<String> = events.iter().map(|e| e.envelope.id.to_string()).collect();
        let stream: Vec<&str> = events.iter().map(|e| e.envelope.stream.as_str()).collect();
        let version: Vec<i64> = events.iter().map(|e| to_i64(e.envelope.version)).collect::<Result<_>>()?;
        let ty: Vec<&str> = events.iter().map(|e| e.envelope.event_type.as_str()).collect();
        let at: Vec<i64> = events.iter().map(|e| to_i64(e.envelope.at_ms)).collect::<Result<_>>()?;
        let idx: Vec<i32> = events
            .iter()
            .map(|e| i32::try_from(e.position.index).map_err(|_| Error::Internal("batch too large".into())))
            .collect::<Result<_>>()?;
        let canonical: Vec<&[u8]> = events.iter().map(|e| e.canonical.as_slice()).collect();
        let hash: Vec<&[u8]> = events.iter().map(|e| &e.hash[..]).collect();
        let sig: Vec<&[u8]> = events.iter().map(|e| e.sig.as_slice()).collect();
        let key: Vec<&str> = events.iter().map(|e| e.key_id.as_str()).collect();
        // The statements below do not depend on each other: issued together, tokio-postgres
        // pipelines them over the connection, so the batch pays one round trip instead of four.
        let events_insert = async {
            tx.execute(
                &events_insert_statement,
                &[&t, &seq, &id, &stream, &version, &ty, &at, &commit, &idx, &canonical, &hash, &sig, &key],
            )
            .await
        };
        let ht: Vec<String> = batch.heads_after.iter().map(|(t, _)| t.to_string()).collect();
        let hs: Vec<i64> = batch.heads_after.iter().map(|(_, h)| to_i64(h.seq)).collect::<Result<_>>()?;
        let hh: Vec<&[u8]> = batch.heads_after.iter().map(|(_, h)| &h.hash[..]).collect();
        let heads_upsert = async { tx.execute(&heads_upsert_statement, &[&ht, &hs, &hh]).await };
        let it: Vec<String> = batch.idempotency.iter().map(|(t, _, _)| t.to_string()).collect();
        let ik: Vec<&str> = batch.idempotency.iter().map(|(_, k, _)| k.as_str()).collect();
        let ih: Vec<&[u8]> = batch.idempotency.iter().map(|(_, _, r)| &r.request_hash[..]).collect();
        let first: Vec<i64> = batch.idempotency.iter().map(|(_, _, r)| to_i64(r.first_seq)).collect::<Result<_>>()?;
        let last: Vec<i64> = batch.idempotency.iter().map(|(_, _, r)| to_i64(r.last_seq)).collect::<Result<_>>()?;
        let idempotency_insert = async {
            if it.is_empty() {
                return Ok(0);
            }
            tx.execute(&idempotency_insert_statement, &[&it, &ik, &ih, &first, &last]).await
        };
        let (kt, kk, ki) = row_key_arrays(touched);
        let projections_select = async { tx.query(&projections_select_statement, &[&kt, &kk, &ki]).await };
        let (_, _, _, rows) = futures::try_join!(events_insert, heads_upsert, idempotency_insert, projections_select)?;
        let mut current = HashMap::new();
        for row in rows {
            let row = projection_row_decode(&row)?;
            current.insert(row.key, row.doc);
        }
        Ok(current)
    }

    async fn projections_upsert(&mut self, rows: &[Row]) -> Result<()> {
        let tx = self.client()?;
        let statement = self.cached("INSERT INTO projections (tenant_id, kind, id, doc) SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[])
                 ON CONFLICT (tenant_id, kind, id) DO UPDATE SET doc = excluded.doc").await?;
        for chunk in rows.chunks(ROWS_PER_STATEMENT_MAX) {
            let t: Vec<&str> = chunk.iter().map(|r| r.key.tenant.as_str()).collect();
            let k: Vec<&str> = chunk.iter().map(|r| r.key.kind.as_str()).collect();
            let i: Vec<&str> = chunk.iter().map(|r| r.key.id.as_str()).collect();
            let d: Vec<String> = chunk.iter().map(|r| r.doc.to_string()).collect();
            tx.execute(&statement, &[&t, &k, &i, &d]).await?;
        }
        Ok(())
    }

    async fn projections_delete(&mut self, keys: &[RowKey]) -> Result<()> {
        let (t, k, i) = row_key_arrays(keys);
        self.client()?
            .execute(
                &self
                    .cached(
                        "DELETE FROM projections p USING UNNEST($1::text[], $2::text[], $3::text[]) AS k(t, kd, i)
                 WHERE p.tenant_id = k.t AND p.kind = k.kd AND p.id = k.i",
                    )
                    .await?,
                &[&t, &k, &i],
            )
            .await?;
        Ok(())
    }

    async fn projections_clear(&mut self) -> Result<()> {
        self.client()?.execute("DELETE FROM projections", &[]).await?;
        Ok(())
    }

    async fn migrations_lock(&mut self) -> Result<()> {
        self.client()?
            .batch_execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations (version BIGINT PRIMARY KEY, name TEXT NOT NULL, applied_at_ms BIGINT NOT NULL);
                 LOCK TABLE schema_migrations IN EXCLUSIVE MODE;",
            )
            .await?;
        Ok(())
    }

    async fn migration_applied(&mut self, version: u64) -> Result<bool> {
        let done =
            self.client()?.query_opt("SELECT version FROM schema_migrations WHERE version = $1", &[&to_i64(version)?]).await?;
        Ok(done.is_some())
    }

    async fn migration_apply(&mut self, migration: &Migration, at_ms: u64) -> Result<()> {
        let tx = self.client()?;
        tx.batch_execute(migration.sql).await?;
        tx.execute(
            "INSERT INTO schema_migrations (version, name, applied_at_ms) VALUES ($1, $2, $3)",
            &[&to_i64(migration.version)?, &migration.name, &to_i64(at_ms)?],
        )
        .await?;
        Ok(())
    }

    async fn cursor_create(&mut self, consumer: &str, now_ms: u64) -> Result<()> {
        self.client()?
            .execute(
                "INSERT INTO consumer_cursors (consumer, commit_no, commit_index, lease_owner, lease_until_ms, updated_at_ms) \
                 VALUES ($1, 0, 0, NULL, 0, $2) ON CONFLICT (consumer) DO NOTHING",
                &[&consumer, &to_i64(now_ms)?],
            )
            .await?;
        Ok(())
    }

    async fn cursor_take(&mut self, consumer: &str, owner: &str, now_ms: u64, until_ms: u64) -> Result<Option<Position>> {
        let row = self
            .client()?
            .query_opt(
                &self
                    .cached(
                        "UPDATE consumer_cursors SET lease_owner = $1, lease_until_ms = $2, updated_at_ms = $3 \
                 WHERE consumer = $4 AND (lease_owner IS NULL OR lease_owner = $1 OR lease_until_ms < $3) \
                 RETURNING commit_no, commit_index",
                    )
                    .await?,
                &[&owner, &to_i64(until_ms)?, &to_i64(now_ms)?, &consumer],
            )
            .await?;
        row.map(|row| Ok(Position { commit: to_u64(row.try_get(0)?)?, index: to_u32(row.try_get(1)?)? })).transpose()
    }

    async fn cursor_move(&mut self, consumer: &str, owner: &str, from: Position, to: Position, now_ms: u64) -> Result<bool> {
        let moved = self
            .client()?
            .execute(
                &self
                    .cached(
                        "UPDATE consumer_cursors SET commit_no = $1, commit_index = $2, updated_at_ms = $3 \
                 WHERE consumer = $4 AND lease_owner = $5 AND commit_no = $6 AND commit_index = $7",
                    )
                    .await?,
                &[
                    &to_i64(to.commit)?,
                    &i64::from(to.index),
                    &to_i64(now_ms)?,
                    &consumer,
                    &owner,
                    &to_i64(from.commit)?,
                    &i64::from(from.index),
                ],
            )
            .await?;
        Ok(moved == 1)
    }

    async fn items_insert(
        &mut self,
        consumer: &str,
        items: &[NewWorkItem],
        now_ms: u64,
        claimed_by: Option<(&str, u64)>,
    ) -> Result<Vec<(String, String)>> {
        let tenants: Vec<String> = items.iter().map(|i| i.tenant.to_string()).collect();
        let ids: Vec<&str> = items.iter().map(|i| i.id.as_str()).collect();
        let subjects: Vec<&str> = items.iter().map(|i| i.subject.as_str()).collect();
        let payloads: Vec<String> = items.iter().map(|i| i.payload.to_string()).collect();
        let (owner, lease_until, attempts) = match claimed_by {
            Some((owner, until_ms)) => (Some(owner), to_i64(until_ms)?, 1i64),
            None => (None, 0, 0),
        };
        let sql = format!(
            "INSERT INTO work_items (tenant_id, consumer, id, subject, payload, state, attempts, round_attempts, next_at_ms, \
             lease_owner, lease_until_ms, last_error, created_at_ms, updated_at_ms) \
             SELECT t, $1, i, s, p, 'pending', $7, $7, $2, $8, $9, NULL, $2, $2 \
             FROM UNNEST($3::text[], $4::text[], $5::text[], $6::text[]) AS x(t, i, s, p) \
             ON CONFLICT (tenant_id, consumer, id) DO NOTHING{}",
            // The rows inserted, when they are the caller's to work on.
            if claimed_by.is_some() { " RETURNING tenant_id, id" } else { "" }
        );
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 9] =
            [&consumer, &to_i64(now_ms)?, &tenants, &ids, &subjects, &payloads, &attempts, &owner, &lease_until];
        let rows = self.client()?.query(&self.cached(&sql).await?, &params).await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    async fn items_complete(&mut self, consumer: &str, owner: &str, done: &[Completion]) -> Result<Vec<bool>> {
        // One statement for the whole batch: the guarded update of every item.
        let tenants: Vec<String> = done.iter().map(|c| c.tenant.to_string()).collect();
        let ids: Vec<&str> = done.iter().map(|c| c.id.as_str()).collect();
        let numbers: Vec<i64> = done.iter().map(|c| i64::from(c.attempt.number)).collect();
        let mut states = Vec::with_capacity(done.len());
        let mut next_ats = Vec::with_capacity(done.len());
        let mut updated = Vec::with_capacity(done.len());
        for c in done {
            let (state, next_at) = outcome_columns(&c.outcome, c.attempt.at_ms);
            states.push(state.as_str());
            next_ats.push(to_i64(next_at)?);
            updated.push(to_i64(c.attempt.at_ms.saturating_add(c.attempt.latency_ms))?);
        }
        let errors: Vec<Option<&str>> = done.iter().map(|c| c.attempt.error.as_deref()).collect();
        let pending = vec![WorkState::Pending.as_str(); done.len()];
        self.client()?.batch_execute(BY_THE_KEY).await?;
        let moved = self
            .client()?
            .query(
                &self.cached(ITEMS_COMPLETE_SQL).await?,
                &[&tenants, &ids, &states, &next_ats, &errors, &updated, &numbers, &consumer, &owner, &pending],
            )
            .await?;
        // By attempt number too: one batch may hold two attempts of one item.
        let moved: std::collections::HashSet<(String, String, i64)> =
            moved.iter().map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?))).collect::<Result<_>>()?;
        Ok(done
            .iter()
            .zip(&tenants)
            .map(|(c, t)| moved.contains(&(t.clone(), c.id.clone(), i64::from(c.attempt.number))))
            .collect())
    }

    async fn attempts_insert(&mut self, consumer: &str, owner: &str, done: &[&Completion]) -> Result<()> {
        let tenants: Vec<String> = done.iter().map(|c| c.tenant.to_string()).collect();
        let ids: Vec<&str> = done.iter().map(|c| c.id.as_str()).collect();
        let numbers: Vec<i64> = done.iter().map(|c| i64::from(c.attempt.number)).collect();
        let at: Vec<i64> = done.iter().map(|c| to_i64(c.attempt.at_ms)).collect::<Result<_>>()?;
        let latency: Vec<i64> = done.iter().map(|c| to_i64(c.attempt.latency_ms)).collect::<Result<_>>()?;
        let status: Vec<Option<i64>> = done.iter().map(|c| c.attempt.status.map(i64::from)).collect();
        let errors: Vec<Option<&str>> = done.iter().map(|c| c.attempt.error.as_deref()).collect();
        let next: Vec<Option<i64>> = done.iter().map(|c| c.attempt.next_at_ms.map(to_i64).transpose()).collect::<Result<_>>()?;
        self.client()?
            .execute(
                &self.cached("INSERT INTO work_attempts (tenant_id, consumer, item_id, number, at_ms, latency_ms, status, error, next_at_ms, owner) \
                 SELECT t, $1, i, n, a, l, s, e, x, $2 \
                 FROM UNNEST($3::text[], $4::text[], $5::bigint[], $6::bigint[], $7::bigint[], $8::bigint[], $9::text[], $10::bigint[]) \
                      AS u(t, i, n, a, l, s, e, x) \
                 ON CONFLICT (tenant_id, consumer, item_id, number) DO NOTHING").await?,
                &[&consumer, &owner, &tenants, &ids, &numbers, &at, &latency, &status, &errors, &next],
            )
            .await?;
        Ok(())
    }

    async fn items_prune(&mut self, consumer: &str, before_ms: u64, limit: u32) -> Result<Vec<(String, String)>> {
        let gone = self
            .client()?
            .query(
                "DELETE FROM work_items w USING (SELECT tenant_id, consumer, id FROM work_items WHERE consumer = $1 \
                 AND state = 'done' AND updated_at_ms < $2 LIMIT $3 FOR UPDATE SKIP LOCKED) old \
                 WHERE w.tenant_id = old.tenant_id AND w.consumer = old.consumer AND w.id = old.id RETURNING w.tenant_id, w.id",
                &[&consumer, &to_i64(before_ms)?, &i64::from(limit)],
            )
            .await?;
        gone.iter().map(|r| Ok((r.try_get(0)?, r.try_get(1)?))).collect()
    }

    async fn attempts_delete(&mut self, consumer: &str, items: &[(String, String)]) -> Result<()> {
        let tenants: Vec<&str> = items.iter().map(|(t, _)| t.as_str()).collect();
        let ids: Vec<&str> = items.iter().map(|(_, i)| i.as_str()).collect();
        self.client()?
            .execute(
                "DELETE FROM work_attempts a USING UNNEST($2::text[], $3::text[]) AS g(t, i) \
                 WHERE a.tenant_id = g.t AND a.consumer = $1 AND a.item_id = g.i",
                &[&consumer, &tenants, &ids],
            )
            .await?;
        Ok(())
    }
}

#[async_trait]
impl Store for PostgresStore {
    fn backend(&self) -> &'static str {
        "postgresql"
    }

    async fn transaction(&self, _: WriteToken) -> Result<Box<dyn Transaction + '_>> {
        Ok(Box::new(PostgresTransaction::begin(self.pool.get().await?).await?))
    }
}

#[async_trait]
impl EventStore for PostgresStore {
    fn migrations(&self) -> &'static [Migration] {
        MIGRATIONS
    }

    async fn schema_version(&self) -> Result<Option<u64>> {
        let client = self.pool.get().await?;
        // No migrations table yet reads as no migration applied.
        let latest: Option<i64> = match client.query_one("SELECT MAX(version) FROM schema_migrations", &[]).await {
            Ok(row) => row.try_get(0)?,
            Err(_) => None,
        };
        latest.map(to_u64).transpose()
    }

    async fn server_facts(&self) -> Result<super::ServerFacts> {
        let client = self.pool.get().await?;
        let row = client
            .query_one(
                "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint, current_setting('synchronous_commit'), \
                 current_setting('max_connections'), current_setting('synchronous_standby_names'), \
                 (SELECT count(*) FROM pg_stat_replication)::text",
                &[],
            )
            .await?;
        let now_ms: i64 = row.try_get(0)?;
        let settings = vec![
            ("synchronous_commit".to_owned(), row.try_get::<_, String>(1)?),
            ("max_connections".to_owned(), row.try_get::<_, String>(2)?),
            ("synchronous_standby_names".to_owned(), row.try_get::<_, String>(3)?),
            // Standbys streaming from this server now (rows any user may count).
            ("standbys".to_owned(), row.try_get::<_, String>(4)?),
        ];
        Ok(super::ServerFacts { now_ms: Some(to_u64(now_ms)?), settings })
    }
}

#[async_trait]
impl LogStore for PostgresStore {
    async fn preread(&self, query: &PreReadQuery) -> Result<PreRead> {
        let client = self.pool.get().await?;
        preread_on(&client, query).await
    }

    async fn read_chain_rows(&self, tenant: TenantId, from_seq: u64, limit: u32) -> Result<Vec<EventRow>> {
        let client = self.pool.get().await?;
        let from = to_i64(from_seq)?;
        let rows = client
            .query(
                &cached(&client, &read_chain_rows_sql()).await?,
                &[&tenant.to_string(), &from, &from.saturating_add(i64::from(limit))],
            )
            .await?;
        rows.iter().map(event_row_decode).collect()
    }

    async fn read_stream_rows(&self, tenant: TenantId, stream: &str, after_version: u64, limit: u32) -> Result<Vec<EventRow>> {
        let client = self.pool.get().await?;
        let rows = client
            .query(
                &cached(&client, &format!(
                    "SELECT {EVENT_COLUMNS} FROM events WHERE tenant_id = $1 AND stream = $2 AND version > $3 ORDER BY version LIMIT $4"
                )).await?,
                &[&tenant.to_string(), &stream, &to_i64(after_version)?, &i64::from(limit)],
            )
            .await?;
        rows.iter().map(event_row_decode).collect()
    }

    async fn read_after_rows(&self, after: Position, tenant: Option<TenantId>, limit: u32) -> Result<Vec<EventRow>> {
        let client = self.pool.get().await?;
        let index = i32::try_from(after.index).unwrap_or(i32::MAX);
        let rows = match tenant {
            Some(t) => {
                client
                    .query(
                        &cached(&client, &read_after_tenant_sql()).await?,
                        &[&to_i64(after.commit)?, &index, &t.to_string(), &i64::from(limit)],
                    )
                    .await?
            }
            None => {
                client
                    .query(
                        &cached(
                            &client,
                            &format!(
                                "SELECT {EVENT_COLUMNS} FROM events WHERE (commit_no, commit_index) > ($1, $2)
                             ORDER BY commit_no, commit_index LIMIT $3"
                            ),
                        )
                        .await?,
                        &[&to_i64(after.commit)?, &index, &i64::from(limit)],
                    )
                    .await?
            }
        };
        rows.iter().map(event_row_decode).collect()
    }

    async fn read_after_touches(&self, after: Position, limit: u32) -> Result<Vec<super::StreamTouch>> {
        let client = self.pool.get().await?;
        let index = i32::try_from(after.index).unwrap_or(i32::MAX);
        let rows = client
            .query(
                // commit_index is an int4: widened under another name, as EVENT_COLUMNS is, so ORDER BY
                // still sorts by the indexed column.
                "SELECT tenant_id, stream, commit_no, commit_index::int8 AS commit_index_wide FROM events \
                 WHERE (commit_no, commit_index) > ($1, $2) ORDER BY commit_no, commit_index LIMIT $3",
                &[&to_i64(after.commit)?, &index, &i64::from(limit)],
            )
            .await?;
        rows.iter().map(super::touch_decode).collect()
    }

    async fn event_row(&self, tenant: TenantId, id: EventId) -> Result<Option<EventRow>> {
        let client = self.pool.get().await?;
        let row = client
            .query_opt(
                &cached(&client, &format!("SELECT {EVENT_COLUMNS} FROM events WHERE tenant_id = $1 AND id = $2")).await?,
                &[&tenant.to_string(), &id.to_string()],
            )
            .await?;
        row.as_ref().map(event_row_decode).transpose()
    }

    async fn heads(&self) -> Result<Vec<(TenantId, Head)>> {
        let client = self.pool.get().await?;
        let rows =
            client.query(&cached(&client, "SELECT tenant_id, seq, hash FROM chain_heads ORDER BY tenant_id").await?, &[]).await?;
        rows.iter().map(head_decode).collect()
    }

    async fn tenants(&self) -> Result<Vec<TenantId>> {
        let client = self.pool.get().await?;
        let rows = client.query(super::TENANTS_SQL, &[]).await?;
        rows.iter().map(|r| r.try_get::<_, String>(0)?.parse()).collect()
    }

    async fn last_commit(&self) -> Result<u64> {
        let client = self.pool.get().await?;
        to_u64(client.query_one("SELECT last_commit FROM log_counter WHERE id = 1", &[]).await?.try_get(0)?)
    }

    async fn signing_key_put(&self, key_id: &str, public: &[u8; 32], at_ms: u64) -> Result<()> {
        let client = self.pool.get().await?;
        client
            .execute(
                "INSERT INTO signing_keys (key_id, public_key, created_at_ms) VALUES ($1, $2, $3) ON CONFLICT (key_id) DO NOTHING",
                &[&key_id, &&public[..], &to_i64(at_ms)?],
            )
            .await?;
        Ok(())
    }

    async fn signing_keys(&self) -> Result<Vec<(String, Vec<u8>)>> {
        let client = self.pool.get().await?;
        let rows = client.query("SELECT key_id, public_key FROM signing_keys ORDER BY created_at_ms", &[]).await?;
        rows.iter().map(|r| Ok((r.try_get(0)?, r.try_get(1)?))).collect()
    }
}

#[async_trait]
impl RowStore for PostgresStore {
    async fn row_get(&self, tenant: &str, kind: &str, id: &str) -> Result<Option<Row>> {
        let client = self.pool.get().await?;
        let row = client
            .query_opt(
                &cached(
                    &client,
                    "SELECT tenant_id, kind, id, doc FROM projections WHERE tenant_id = $1 AND kind = $2 AND id = $3",
                )
                .await?,
                &[&tenant, &kind, &id],
            )
            .await?;
        row.as_ref().map(projection_row_decode).transpose()
    }

    async fn rows_get_raw(&self, tenant: &str, kind: &str, ids: &[&str]) -> Result<Vec<RawRow>> {
        super::check_rows_get(ids)?;
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let client = self.pool.get().await?;
        let rows = client
            .query(
                &cached(&client, "SELECT tenant_id, kind, id, doc FROM projections WHERE tenant_id = $1 AND kind = $2 AND id = ANY($3) ORDER BY id").await?,
                &[&tenant, &kind, &ids],
            )
            .await?;
        rows.iter().map(raw_row_decode).collect()
    }

    async fn row_find(&self, kind: &str, id: &str) -> Result<Option<Row>> {
        let client = self.pool.get().await?;
        let row = client
            .query_opt(
                &cached(&client, "SELECT tenant_id, kind, id, doc FROM projections WHERE kind = $1 AND id = $2").await?,
                &[&kind, &id],
            )
            .await?;
        row.as_ref().map(projection_row_decode).transpose()
    }

    async fn row_list_raw(&self, tenant: &str, kind: &str, after_id: Option<&str>, limit: u32) -> Result<Vec<RawRow>> {
        let client = self.pool.get().await?;
        let rows = client
            .query(&cached(&client, ROW_LIST_SQL).await?, &[&tenant, &kind, &after_id.unwrap_or(""), &i64::from(limit)])
            .await?;
        rows.iter().map(raw_row_decode).collect()
    }

    async fn row_last(&self, tenant: &str, kind: &str) -> Result<Option<Row>> {
        let client = self.pool.get().await?;
        let row = client.query_opt(&cached(&client, ROW_LAST_SQL).await?, &[&tenant, &kind]).await?;
        row.as_ref().map(projection_row_decode).transpose()
    }

    async fn rows_all(&self) -> Result<Vec<Row>> {
        let client = self.pool.get().await?;
        let rows = client
            .query(
                "SELECT tenant_id, kind, id, doc FROM projections ORDER BY tenant_id COLLATE \"C\", kind COLLATE \"C\", id COLLATE \"C\"",
                &[],
            )
            .await?;
        rows.iter().map(projection_row_decode).collect()
    }
}

columns_by_try_get!(tokio_postgres::Row);

#[async_trait]
impl OutboxStore for PostgresStore {
    async fn cursor_position(&self, consumer: &str) -> Result<Option<Position>> {
        let client = self.pool.get().await?;
        let row =
            client.query_opt("SELECT commit_no, commit_index FROM consumer_cursors WHERE consumer = $1", &[&consumer]).await?;
        row.map(|row| Ok(Position { commit: to_u64(row.try_get(0)?)?, index: to_u32(row.try_get(1)?)? })).transpose()
    }

    async fn cursor_release(&self, consumer: &str, owner: &str) -> Result<()> {
        let client = self.pool.get().await?;
        client
            .execute(
                "UPDATE consumer_cursors SET lease_owner = NULL, lease_until_ms = 0 WHERE consumer = $1 AND lease_owner = $2",
                &[&consumer, &owner],
            )
            .await?;
        Ok(())
    }

    async fn work_claim(&self, consumer: &str, owner: &str, now_ms: u64, lease_ms: u64, limit: u32) -> Result<Vec<WorkItem>> {
        let client = self.pool.get().await?;
        let now = to_i64(now_ms)?;
        let rows = client
            .query(
                &cached(&client, &claim_sql()).await?,
                &[&owner, &to_i64(now_ms.saturating_add(lease_ms))?, &now, &consumer, &i64::from(limit.min(CLAIM_ITEMS_MAX))],
            )
            .await?;
        rows.iter().map(WorkItem::decode).collect()
    }

    async fn work_release(&self, consumer: &str, owner: &str, items: &[(TenantId, String, u32)]) -> Result<u64> {
        if items.is_empty() {
            return Ok(0);
        }
        let tenants: Vec<String> = items.iter().map(|(t, _, _)| t.to_string()).collect();
        let ids: Vec<&str> = items.iter().map(|(_, i, _)| i.as_str()).collect();
        let numbers: Vec<i64> = items.iter().map(|(_, _, n)| i64::from(*n)).collect();
        let pending = vec![WorkState::Pending.as_str(); items.len()];
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        tx.batch_execute(BY_THE_KEY).await?;
        let released = tx.execute(WORK_RELEASE_SQL, &[&tenants, &ids, &numbers, &consumer, &owner, &pending]).await?;
        tx.commit().await?;
        Ok(released)
    }

    async fn work_get(&self, consumer: &str, tenant: TenantId, id: &str) -> Result<Option<WorkItem>> {
        let client = self.pool.get().await?;
        let row = client
            .query_opt(
                &format!("SELECT {ITEM_COLUMNS} FROM work_items WHERE tenant_id = $1 AND consumer = $2 AND id = $3"),
                &[&tenant.to_string(), &consumer, &id],
            )
            .await?;
        row.as_ref().map(WorkItem::decode).transpose()
    }

    async fn work_list(
        &self,
        consumer: &str,
        tenant: TenantId,
        subject: &str,
        state: Option<WorkState>,
        before_id: Option<&str>,
        limit: u32,
    ) -> Result<Vec<WorkItem>> {
        let client = self.pool.get().await?;
        let rows = client
            .query(
                &format!(
                    "SELECT {ITEM_COLUMNS} FROM work_items WHERE tenant_id = $1 AND consumer = $2 AND subject = $3 \
                     AND ($4::text IS NULL OR state = $4) AND ($5::text IS NULL OR id < $5) ORDER BY id DESC LIMIT $6"
                ),
                &[&tenant.to_string(), &consumer, &subject, &state.map(WorkState::as_str), &before_id, &i64::from(limit)],
            )
            .await?;
        rows.iter().map(WorkItem::decode).collect()
    }

    async fn work_requeue(&self, consumer: &str, tenant: TenantId, id: &str, now_ms: u64) -> Result<bool> {
        let client = self.pool.get().await?;
        let moved = client
            .execute(
                "UPDATE work_items SET state = 'pending', next_at_ms = $1, round_attempts = 0, lease_owner = NULL, \
                 lease_until_ms = 0, updated_at_ms = $1 WHERE tenant_id = $2 AND consumer = $3 AND id = $4 AND state <> 'pending'",
                &[&to_i64(now_ms)?, &tenant.to_string(), &consumer, &id],
            )
            .await?;
        Ok(moved == 1)
    }

    async fn attempts(&self, consumer: &str, tenant: TenantId, id: &str) -> Result<Vec<Attempt>> {
        let client = self.pool.get().await?;
        let rows = client
            .query(
                &format!(
                    "SELECT {ATTEMPT_COLUMNS} FROM work_attempts \
                     WHERE tenant_id = $1 AND consumer = $2 AND item_id = $3 ORDER BY number"
                ),
                &[&tenant.to_string(), &consumer, &id],
            )
            .await?;
        rows.iter().map(Attempt::decode).collect()
    }

    async fn work_counts(&self, consumer: &str) -> Result<(u64, u64, u64)> {
        let client = self.pool.get().await?;
        let rows =
            client.query("SELECT state, COUNT(*) FROM work_items WHERE consumer = $1 GROUP BY state", &[&consumer]).await?;
        let rows: Vec<(String, u64)> =
            rows.iter().map(|row| Ok((row.try_get(0)?, to_u64(row.try_get(1)?)?))).collect::<Result<_>>()?;
        Ok(count_states(rows))
    }
}

#[async_trait]
impl SecretStore for PostgresStore {
    async fn secret_put_raw(&self, tenant: TenantId, id: &str, stored: &str, now_ms: u64) -> Result<()> {
        let client = self.pool.get().await?;
        client
            .execute(
                "INSERT INTO secrets (tenant_id, id, value, created_at_ms) VALUES ($1, $2, $3, $4)",
                &[&tenant.to_string(), &id, &stored, &to_i64(now_ms)?],
            )
            .await?;
        Ok(())
    }

    async fn secret_get_raw(&self, tenant: TenantId, id: &str) -> Result<Option<String>> {
        let client = self.pool.get().await?;
        let row =
            client.query_opt("SELECT value FROM secrets WHERE tenant_id = $1 AND id = $2", &[&tenant.to_string(), &id]).await?;
        row.map(|r| r.try_get(0).map_err(Error::from)).transpose()
    }

    async fn secret_delete(&self, tenant: TenantId, id: &str) -> Result<()> {
        let client = self.pool.get().await?;
        client.execute("DELETE FROM secrets WHERE tenant_id = $1 AND id = $2", &[&tenant.to_string(), &id]).await?;
        Ok(())
    }

    async fn secrets_count(&self, tenant: TenantId) -> Result<u64> {
        let client = self.pool.get().await?;
        let row = client.query_one("SELECT COUNT(*) FROM secrets WHERE tenant_id = $1", &[&tenant.to_string()]).await?;
        let n: i64 = row.try_get(0)?;
        Ok(n as u64)
    }

    async fn secrets_page_raw(&self, after: Option<(String, String)>, limit: u32) -> Result<Vec<(String, String, String)>> {
        let client = self.pool.get().await?;
        let (tenant, id) = after.unwrap_or_default();
        let rows = client
            .query(
                "SELECT tenant_id, id, value FROM secrets WHERE (tenant_id, id) > ($1, $2) ORDER BY tenant_id, id LIMIT $3",
                &[&tenant, &id, &i64::from(limit)],
            )
            .await?;
        rows.iter().map(|row| Ok((row.try_get(0)?, row.try_get(1)?, row.try_get(2)?))).collect()
    }

    async fn secret_replace_raw(&self, tenant: &str, id: &str, old: &str, new: &str) -> Result<bool> {
        let client = self.pool.get().await?;
        let n = client
            .execute("UPDATE secrets SET value = $1 WHERE tenant_id = $2 AND id = $3 AND value = $4", &[&new, &tenant, &id, &old])
            .await?;
        Ok(n == 1)
    }

    fn data_keys(&self) -> Option<std::sync::Arc<crate::sealing::DataKeys>> {
        self.data_keys.read().expect("data keys").clone()
    }

    fn set_data_keys(&self, keys: std::sync::Arc<crate::sealing::DataKeys>) {
        *self.data_keys.write().expect("data keys") = Some(keys);
    }
}

#[async_trait]
impl StatusStore for PostgresStore {
    async fn pass_record(&self, pass: &PassRecord, forget_before_ms: u64) -> Result<()> {
        let client = self.pool.get().await?;
        client
            .execute(
                "INSERT INTO reconciler_passes (name, instance, started_at_ms, duration_ms, ok, counts, error, passes) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
             ON CONFLICT (name, instance) DO UPDATE SET started_at_ms = excluded.started_at_ms, \
             duration_ms = excluded.duration_ms, ok = excluded.ok, counts = excluded.counts, error = excluded.error, \
             passes = reconciler_passes.passes + excluded.passes",
                &[
                    &pass.name,
                    &pass.instance,
                    &to_i64(pass.started_at_ms)?,
                    &to_i64(pass.duration_ms)?,
                    &i64::from(pass.ok),
                    &pass.counts_json()?,
                    &pass.error_text(),
                    &to_i64(pass.passes)?,
                ],
            )
            .await?;
        client.execute("DELETE FROM reconciler_passes WHERE started_at_ms < $1", &[&to_i64(forget_before_ms)?]).await?;
        Ok(())
    }

    async fn passes(&self) -> Result<Vec<PassRecord>> {
        let client = self.pool.get().await?;
        let rows = client.query(&format!("SELECT {PASS_COLUMNS} FROM reconciler_passes ORDER BY name, instance"), &[]).await?;
        rows.iter().map(PassRecord::decode).collect()
    }
}

/// A tenant's read by position: parameters commit, index, tenant, limit.
fn read_after_tenant_sql() -> String {
    format!(
        "SELECT {EVENT_COLUMNS} FROM events WHERE (commit_no, commit_index) > ($1, $2) AND tenant_id = $3
         ORDER BY commit_no, commit_index LIMIT $4"
    )
}

#[async_trait]
impl super::lease::LeaseStore for PostgresStore {
    async fn lease_renew(&self, leases: &[(String, String, u64)]) -> Result<()> {
        // One statement: a gateway renews every node it holds a session to. (The keys are
        // distinct: the renewals are a map.)
        let (mut tenants, mut nodes, mut expires) = (Vec::new(), Vec::new(), Vec::new());
        for (tenant, node, at) in leases {
            tenants.push(tenant.as_str());
            nodes.push(node.as_str());
            expires.push(to_i64(*at)?);
        }
        let client = self.pool.get().await?;
        client
            .execute(
                "INSERT INTO node_leases (tenant_id, node_id, expires_at_ms) \
                 SELECT * FROM UNNEST($1::text[], $2::text[], $3::bigint[]) \
                 ON CONFLICT (tenant_id, node_id) DO UPDATE SET expires_at_ms = GREATEST(node_leases.expires_at_ms, excluded.expires_at_ms)",
                &[&tenants, &nodes, &expires],
            )
            .await?;
        Ok(())
    }

    async fn lease_changes(&self, now_ms: u64, limit: u32) -> Result<Vec<super::lease::Lease>> {
        let client = self.pool.get().await?;
        let rows = client
            .query(
                &format!(
                    "SELECT {} FROM node_leases WHERE (expires_at_ms > $1) <> (reported_reachable = 1) LIMIT $2",
                    super::lease::LEASE_COLUMNS
                ),
                &[&to_i64(now_ms)?, &i64::from(limit)],
            )
            .await?;
        rows.iter().map(super::lease::Lease::decode).collect()
    }

    async fn lease_reported(&self, tenant: &str, node: &str, reachable: bool) -> Result<()> {
        let client = self.pool.get().await?;
        client
            .execute(
                "UPDATE node_leases SET reported_reachable = $1 WHERE tenant_id = $2 AND node_id = $3",
                &[&i64::from(reachable), &tenant, &node],
            )
            .await?;
        Ok(())
    }

    async fn lease_get(&self, tenant: &str, node: &str) -> Result<Option<super::lease::Lease>> {
        let client = self.pool.get().await?;
        let row = client
            .query_opt(
                &format!("SELECT {} FROM node_leases WHERE tenant_id = $1 AND node_id = $2", super::lease::LEASE_COLUMNS),
                &[&tenant, &node],
            )
            .await?;
        row.as_ref().map(super::lease::Lease::decode).transpose()
    }

    async fn lease_claim(&self, claim: &super::lease::LeaseClaim, expires_at_ms: u64) -> Result<()> {
        let client = self.pool.get().await?;
        client
            .execute(
                "INSERT INTO node_leases (tenant_id, node_id, expires_at_ms, holder, claimed_at_ms) VALUES ($1, $2, $3, $4, $5) \
                 ON CONFLICT (tenant_id, node_id) DO UPDATE SET expires_at_ms = GREATEST(node_leases.expires_at_ms, excluded.expires_at_ms), \
                 holder = excluded.holder, claimed_at_ms = excluded.claimed_at_ms",
                &[&claim.tenant, &claim.node, &to_i64(expires_at_ms)?, &claim.holder, &to_i64(claim.claimed_at_ms)?],
            )
            .await?;
        Ok(())
    }

    async fn lease_claims_since(&self, since_ms: u64, limit: u32) -> Result<Vec<super::lease::LeaseClaim>> {
        let client = self.pool.get().await?;
        let rows = client
            .query(
                &format!(
                    "SELECT {} FROM node_leases WHERE claimed_at_ms >= $1 ORDER BY claimed_at_ms LIMIT $2",
                    super::lease::CLAIM_COLUMNS
                ),
                &[&to_i64(since_ms)?, &i64::from(limit)],
            )
            .await?;
        rows.iter().map(super::lease::LeaseClaim::decode).collect()
    }
}

/// A claim of due items ([`OutboxStore::work_claim`]): `$1` the owner, `$2` its lease's end, `$3`
/// now, `$4` the consumer, `$5` how many at most. SKIP LOCKED: processes claiming at once each
/// take different rows and never wait. It changes no indexed column (not even `updated_at_ms`,
/// which the done items' index holds), so its new row version is written beside the old one on
/// the same page without an entry in any index (a heap-only tuple; 0007's fillfactor leaves
/// the room for it; `plan_tests`). The locked rows are updated where they lie (`ctid`, a TID
/// scan), not found again by a key: joined by `(tenant_id, consumer, id)` the planner took
/// `work_items_by_subject`, whose third column is not the id, and walked every item of the
/// tenant once per claimed row (the plan test found it at every item size; seen live at 1.1 ms
/// a row). A row another process changed after this statement began is not seen by
/// the TID scan and stays unclaimed, never claimed twice.
fn claim_sql() -> String {
    format!(
        "UPDATE work_items w SET lease_owner = $1, lease_until_ms = $2, attempts = w.attempts + 1, \
         round_attempts = w.round_attempts + 1 \
         FROM (SELECT ctid FROM work_items WHERE consumer = $4 AND state = 'pending' \
               AND next_at_ms <= $3 AND lease_until_ms <= $3 ORDER BY next_at_ms LIMIT $5 \
               FOR UPDATE SKIP LOCKED) due \
         WHERE w.ctid = due.ctid \
         RETURNING {}",
        ITEM_COLUMNS.split(", ").map(|c| format!("w.{}", c.trim())).collect::<Vec<_>>().join(", ")
    )
}

/// The guarded update of a batch of completions. The state an item must still be in comes with
/// the batch (`was`), not as a constant: with `w.state = 'pending'` the planner may drive the
/// join from the partial index of due items, and on a table it has no statistics for yet (a new
/// deployment's first minute, before autovacuum's first analyze) it guesses that index holds a
/// row or two and scans every pending item once per row of the batch (0.6 s for a batch of 93
/// against 20,000 pending, against 3 ms by the primary key). With `was` only the primary key can
/// find the rows (`plan_tests`).
const ITEMS_COMPLETE_SQL: &str = "UPDATE work_items w SET state = u.state, next_at_ms = u.next_at, lease_owner = NULL, \
     lease_until_ms = 0, last_error = u.err, updated_at_ms = u.upd \
     FROM UNNEST($1::text[], $2::text[], $3::text[], $4::bigint[], $5::text[], $6::bigint[], $7::bigint[], $10::text[]) \
          AS u(t, i, state, next_at, err, upd, num, was) \
     WHERE w.tenant_id = u.t AND w.consumer = $8 AND w.id = u.i AND w.lease_owner = $9 \
       AND w.attempts = u.num AND w.state = u.was \
     RETURNING w.tenant_id, w.id, w.attempts";

/// Run in the transaction of [`ITEMS_COMPLETE_SQL`] and [`WORK_RELEASE_SQL`], before them: their
/// rows are found by the primary key, never by a scan of the table. The guards name the lease's
/// owner, and where the table's statistics predate this process's leases (a queue changes
/// faster than autovacuum analyzes it) the planner takes that owner for one row and a scan of
/// every item, joined to the batch row by row, for the cheapest plan (seen live on a table of
/// 3,000 items of about 100 bytes: 50 ms for a batch of 100, against 4 ms by the key; with the
/// bodies webhook items keep, from about 300 bytes down; `plan_tests`).
const BY_THE_KEY: &str = "SET LOCAL enable_seqscan = off";

/// Claimed items given back unattempted; `was` as in [`ITEMS_COMPLETE_SQL`].
const WORK_RELEASE_SQL: &str = "UPDATE work_items w SET lease_owner = NULL, lease_until_ms = 0, \
     attempts = w.attempts - 1, round_attempts = w.round_attempts - 1 \
     FROM UNNEST($1::text[], $2::text[], $3::bigint[], $6::text[]) AS r(t, i, num, was) \
     WHERE w.tenant_id = r.t AND w.consumer = $4 AND w.id = r.i AND w.lease_owner = $5 \
       AND w.attempts = r.num AND w.state = r.was";

#[cfg(test)]
mod plan_tests {
    use super::*;

    /// A scratch database (dropped with the first value) with a store migrated as `serve`
    /// migrates it.
    async fn migrated() -> (crate::testing::ScratchDatabase, PostgresStore) {
        let db = crate::testing::ScratchDatabase::create().await.expect("PostgreSQL for the plan test");
        let store = PostgresStore::connect(&db.url).await.unwrap();
        crate::store::EventStore::migrate(&store).await.unwrap();
        (db, store)
    }

    /// The plan PostgreSQL makes for `sql` with `params`, its lines joined by ` | `.
    async fn explain(
        client: &impl deadpool_postgres::GenericClient,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> String {
        let rows = client.query(&format!("EXPLAIN {sql}"), params).await.unwrap();
        rows.iter().map(|r| r.get::<_, String>(0)).collect::<Vec<_>>().join(" | ")
    }

    /// Regression: a tenant's read by position must be able to walk
    /// `events_by_tenant_position` (sequential scans turned off, so the planner shows whether
    /// an index serves the query at all on a small test table).
    #[tokio::test]
    async fn a_tenants_read_by_position_uses_its_index() {
        let (_db, store) = migrated().await;
        let client = store.pool.get().await.unwrap();
        client.batch_execute("SET enable_seqscan = off").await.unwrap();
        let plan = explain(&client, &read_after_tenant_sql(), &[&0i64, &0i32, &"ten_00000000000000000000000000", &10i64]).await;
        assert!(plan.contains("events_by_tenant_position"), "{plan}");
        assert!(!plan.contains("Sort"), "no sort: {plan}");
        // Every tenant's read by position walks the position index in order too.
        let every_tenant = format!(
            "SELECT {EVENT_COLUMNS} FROM events WHERE (commit_no, commit_index) > ($1, $2) \
             ORDER BY commit_no, commit_index LIMIT $3"
        );
        let plan = explain(&client, &every_tenant, &[&0i64, &0i32, &10i64]).await;
        assert!(plan.contains("events_by_position") && !plan.contains("Sort"), "{plan}");
    }

    /// Regression: a list method's page walks the projections' primary key in the
    /// page's (byte) order; under the database's own collation it read every row of the kind
    /// and sorted them, page after page. And a chain's page reads past its range only when the
    /// range is short (a one-time filter), whatever the statistics.
    #[tokio::test]
    async fn a_list_page_and_a_chain_page_read_only_their_rows() {
        let (_db, store) = migrated().await;
        let client = store.pool.get().await.unwrap();
        client
            .batch_execute(
                "INSERT INTO projections SELECT 'ten_0', 'node', 'node_' || lpad(g::text, 6, '0'), '{}' FROM generate_series(1, 5000) g",
            )
            .await
            .unwrap();
        for after in ["", "node_002500"] {
            let plan = explain(&client, ROW_LIST_SQL, &[&"ten_0", &"node", &after, &100i64]).await;
            assert!(plan.contains("projections_pkey") && !plan.contains("Sort"), "{plan}");
        }
        let plan = explain(&client, ROW_LAST_SQL, &[&"ten_0", &"node"]).await;
        assert!(plan.contains("Index Scan Backward using projections_pkey") && !plan.contains("Sort"), "{plan}");
        let plan = explain(&client, &read_chain_rows_sql(), &[&"ten_0", &1i64, &1001i64]).await;
        assert!(plan.contains("One-Time Filter"), "{plan}");
    }

    /// Regression: a batch of completions (and of items given back) finds its rows
    /// by the primary key even on a table the planner has no statistics for, where a constant
    /// `state = 'pending'` let it drive the join from the partial index of due items and scan
    /// every pending item once per row of the batch.
    #[tokio::test]
    async fn a_batch_of_completions_finds_its_items_by_the_primary_key() {
        // Items the size of a large event's delivery body down to a ping's (the planner weighs
        // the indexes by the table's size).
        for payload_chars in [900, 300, 60] {
            completions_plan(payload_chars, 20_000, false).await;
            // Small items on a small table analyzed before the leases, so its statistics know no
            // owner `me`: without `BY_THE_KEY` the planner scans the table.
            completions_plan(payload_chars, 3_000, true).await;
        }
    }

    /// A backlog of `items` pending items, 160 of them leased to `me`, on a table analyzed never
    /// or only before the leases.
    async fn completions_plan(payload_chars: i32, items: i32, analyzed: bool) {
        let (_db, store) = migrated().await;
        let mut client = store.pool.get().await.unwrap();
        client
            .batch_execute(&format!(
                "INSERT INTO work_items SELECT 'ten_0', 'webhooks', 'id' || lpad(g::text, 6, '0'), 's', \
                 repeat('x', {payload_chars}), 'pending', 0, 0, g / 250, NULL, 0, NULL, 0, 0 FROM generate_series(1, {items}) g; \
                 {} UPDATE work_items SET lease_owner = 'me', lease_until_ms = 60000, attempts = 1 WHERE id <= 'id000160'",
                if analyzed { "ANALYZE work_items;" } else { "" }
            ))
            .await
            .unwrap();
        let client = client.transaction().await.unwrap();
        client.batch_execute(BY_THE_KEY).await.unwrap();
        let n = 93;
        let tenants = vec!["ten_0"; n];
        let ids: Vec<String> = (1..=n).map(|g| format!("id{g:06}")).collect();
        let (states, errors) = (vec!["done"; n], vec![None::<&str>; n]);
        let (numbers, zeros, was) = (vec![1i64; n], vec![5i64; n], vec![WorkState::Pending.as_str(); n]);
        let complete = explain(
            &client,
            ITEMS_COMPLETE_SQL,
            &[&tenants, &ids, &states, &zeros, &errors, &zeros, &numbers, &"webhooks", &"me", &was],
        )
        .await;
        assert!(complete.contains("work_items_pkey") && !complete.contains("work_items_due"), "{complete}");
        let release = explain(&client, WORK_RELEASE_SQL, &[&tenants, &ids, &numbers, &"webhooks", &"me", &was]).await;
        assert!(release.contains("work_items_pkey") && !release.contains("work_items_due"), "{release}");
        assert!(!complete.contains("Seq Scan") && !release.contains("Seq Scan"), "{complete} || {release}");
        // And a claim of that backlog updates the rows it locked where they lie.
        let claim = explain(&client, &claim_sql(), &[&"you", &120_000i64, &70_000i64, &"webhooks", &100i64]).await;
        assert!(claim.contains("Tid Scan") && !claim.contains("work_items_by_subject"), "{claim}");
    }

    /// Regression: a claim's update is heap-only on a table migrated as `serve`
    /// migrates it: it writes no indexed column and finds room on the row's page, so it costs
    /// no index entries (counted by PostgreSQL for the claim's own transaction).
    #[tokio::test]
    async fn a_claim_updates_its_items_without_touching_an_index() {
        let (_db, store) = migrated().await;
        let items: Vec<NewWorkItem> = (0..200)
            .map(|i| NewWorkItem {
                tenant: TenantId::ROOT,
                id: format!("item{i:03}"),
                subject: "s".into(),
                payload: serde_json::json!({ "body": "x".repeat(900) }),
            })
            .collect();
        store.work_insert("webhooks", &items, 1_000).await.unwrap();
        let mut client = store.pool.get().await.unwrap();
        let tx = client.transaction().await.unwrap();
        // Claimed a second after they were made.
        let claimed = tx.query(&claim_sql(), &[&"me", &62_000i64, &2_000i64, &"webhooks", &50i64]).await.unwrap();
        assert_eq!(claimed.len(), 50);
        let counts = tx
            .query_one("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables WHERE relname = 'work_items'", &[])
            .await
            .unwrap();
        let (updated, hot): (i64, i64) = (counts.get(0), counts.get(1));
        assert_eq!((updated, hot), (50, 50), "every claimed row heap-only");
        // The claimed rows are updated where they lie, whatever indexes the planner could use.
        let plan = explain(&tx, &claim_sql(), &[&"me", &62_000i64, &2_000i64, &"webhooks", &50i64]).await;
        assert!(plan.contains("Tid Scan") && !plan.contains("work_items_by_subject"), "{plan}");
    }
}
