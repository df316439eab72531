//! Storage: the store traits, split by concern, the store algorithm written once, its two
//! backends, and the group-committing [`Log`].
//!
//! The traits (callers name the umbrella, `Arc<dyn EventStore>`; the methods are the same):
//! - [`Store`]: the backend's name, and the hidden door to a write transaction, which only this
//!   module tree can open (it takes a [`WriteToken`], whose field is private here);
//! - [`LogStore`]: the log, read (events by chain, stream, position and id; chain heads;
//!   tenants; the commit counter; the pre-read an append is decided on) and the signing keys;
//! - [`RowStore`]: the projection rows (get, find, list, all, and the swap of a rebuild);
//! - [`outbox::OutboxStore`]: consumer cursors, work items and attempts;
//! - [`SecretStore`]: write-only secrets;
//! - [`EventStore`]: all of the above, plus the schema (migrations and their check).
//!
//! There is no public `commit`: only the [`Log`] appends, so every event is chained, signed and
//! committed with its projections.
//!
//! **Invariants.** SQL is written only in the two backends (`sqlite`, `postgres`); every
//! algorithm over it (the append commit, the locked commit, the rebuild's swap, migrations and
//! the schema check) is written once, over a small per-dialect transaction trait. The `Log`
//! decides, hashes and signs *outside* any database transaction, with ids from its
//! [`IdSource`](crate::id_source::IdSource) and time from its clock, and then commits a batch in
//! one transaction that re-checks the chain heads it built on.
//!
//! The outbox position (`COMMIT.INDEX`) is assigned inside the commit transaction from a
//! one-row counter that every append transaction updates first. The row lock serialises append
//! transactions, so commit numbers are gap-free and follow commit order: a reader that has seen
//! commit `n` can never later find a commit numbered below `n`.

use std::collections::{BTreeMap, HashMap};

use async_trait::async_trait;
use ciborium::Value;

use crate::error::{Error, Result};
use crate::event::{
    EVENT_TYPE_BYTES_MAX, EventRow, LABEL_BYTES_MAX, Position, STREAM_NAME_BYTES_MAX, StoredEvent, sha256, validate_name,
};
use crate::id::{EventId, TenantId};

mod engine;
pub mod lease;
pub mod log;
pub mod outbox;
pub mod postgres;
pub mod sqlite;
pub mod status;

pub use engine::Migration;
pub use log::{APPENDS_STOPPED, AppendObserver, COMMIT_ANSWER_LOST, COMMIT_FAILED, Log, LogHandle, LogStats};

/// Most events one append request may carry.
pub const APPEND_EVENTS_MAX: usize = 500;
/// Streams one append may guard.
pub const GUARDS_MAX: usize = 8;
/// Most events the appender commits in one transaction.
pub const BATCH_EVENTS_MAX: usize = 1000;
/// Most rows one read returns.
pub const READ_ROWS_MAX: u32 = 1000;
const _: () = assert!(APPEND_EVENTS_MAX <= BATCH_EVENTS_MAX);

/// Optimistic concurrency on one stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpectedVersion {
    /// Append whatever the stream's version.
    Any,
    /// The stream must not exist yet (creates).
    NoStream,
    /// The stream must be at exactly this version.
    Exact(u64),
}

impl ExpectedVersion {
    /// Whether a stream at version `current` (0: no stream) satisfies this expectation.
    pub fn admits(self, current: u64) -> bool {
        match self {
            Self::Any => true,
            Self::NoStream => current == 0,
            Self::Exact(v) => current == v,
        }
    }
}

impl std::fmt::Display for ExpectedVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Any => f.write_str("any"),
            Self::NoStream => f.write_str("0 (no stream)"),
            Self::Exact(v) => write!(f, "{v}"),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct NewEvent {
    /// Another stream of the request's tenant for this event, which must be one of the
    /// request's guards: its version is checked there and the event takes the next one. So one
    /// append can move two streams at once (a reservation and the node whose GPUs it takes).
    /// `None`: the request's own stream.
    pub stream: Option<String>,
    pub event_type: String,
    pub payload: Value,
}

/// One append: events for one stream of one tenant (and, through guards, others of the same
/// tenant), committed together or not at all.
#[derive(Clone, Debug)]
pub struct AppendRequest {
    pub tenant: TenantId,
    pub stream: String,
    pub expected: ExpectedVersion,
    pub idempotency_key: Option<String>,
    pub actor: String,
    pub causation: Option<String>,
    pub correlation: Option<String>,
    /// What the caller asked for, for idempotency: when set (the gateway hashes the method and
    /// its JSON body), a retry is "the same request" if this matches, even though the retry
    /// drew fresh ids for what it would create. When unset, the stream and events are hashed.
    pub fingerprint: Option<[u8; 32]>,
    /// Other streams of the same tenant that must be at these versions for the append to
    /// happen, though nothing is appended to them (a node registers only into a pool that is
    /// still at the version the caller read). Sound because any append to a guarded stream
    /// moves the tenant's chain head, which the commit re-checks.
    pub guards: Vec<(String, ExpectedVersion)>,
    pub events: Vec<NewEvent>,
}

impl NewEvent {
    /// An event for the request's own stream.
    pub fn new(event_type: impl Into<String>, payload: Value) -> Self {
        Self { stream: None, event_type: event_type.into(), payload }
    }
}

impl AppendRequest {
    /// `events` for `stream` by `actor`: no idempotency key, links, fingerprint or guards.
    pub fn new(
        tenant: TenantId,
        stream: impl Into<String>,
        expected: ExpectedVersion,
        actor: impl Into<String>,
        events: Vec<NewEvent>,
    ) -> Self {
        Self {
            tenant,
            stream: stream.into(),
            expected,
            idempotency_key: None,
            actor: actor.into(),
            causation: None,
            correlation: None,
            fingerprint: None,
            guards: vec![],
            events,
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.events.is_empty() || self.events.len() > APPEND_EVENTS_MAX {
            return Err(Error::invalid(format!("an append carries 1 to {APPEND_EVENTS_MAX} events")));
        }
        validate_name("stream", &self.stream, STREAM_NAME_BYTES_MAX)?;
        validate_name("actor", &self.actor, LABEL_BYTES_MAX)?;
        for (what, value) in
            [("idempotency key", &self.idempotency_key), ("causation", &self.causation), ("correlation", &self.correlation)]
        {
            if let Some(value) = value {
                validate_name(what, value, LABEL_BYTES_MAX)?;
            }
        }
        for event in &self.events {
            validate_name("event type", &event.event_type, EVENT_TYPE_BYTES_MAX)?;
            if let Some(stream) = &event.stream
                && (*stream == self.stream || !self.guards.iter().any(|(g, _)| g == stream))
            {
                return Err(Error::invalid(format!("event stream {stream:?} is not one of the append's guarded streams")));
            }
        }
        if self.guards.len() > GUARDS_MAX {
            return Err(Error::invalid(format!("at most {GUARDS_MAX} guarded streams")));
        }
        for (stream, _) in &self.guards {
            validate_name("guarded stream", stream, STREAM_NAME_BYTES_MAX)?;
        }
        Ok(())
    }

    /// What makes two requests "the same" for idempotency: the stream and the events.
    pub fn request_hash(&self) -> Result<[u8; 32]> {
        if let Some(fingerprint) = self.fingerprint {
            return Ok(fingerprint);
        }
        let events = self
            .events
            .iter()
            .map(|e| {
                let stream = e.stream.as_ref().map(|s| Value::Text(s.clone())).unwrap_or(Value::Null);
                Value::Array(vec![stream, Value::Text(e.event_type.clone()), e.payload.clone()])
            })
            .collect();
        let bytes = crate::canonical::encode(Value::Array(vec![Value::Text(self.stream.clone()), Value::Array(events)]))?;
        Ok(sha256(&bytes))
    }
}

#[derive(Clone, Debug)]
pub struct AppendResult {
    pub events: Vec<StoredEvent>,
    /// True when an idempotency key matched an earlier append: nothing new was written.
    pub replayed: bool,
    /// The projection rows this request's events touched, as its commit left them (`None`: the
    /// row was deleted): the state after every event of the commit, this request's and any
    /// batched after it, so what a read right after the commit would return, without the read.
    /// Empty for a replay, whose caller reads the rows as they are now.
    pub rows: Vec<(RowKey, Option<serde_json::Value>)>,
    /// The commit's receipt, shared by every answer it gave: when the last of them is let go
    /// (each caller has used its answer: a handler has made its response), [`Log::answered`]
    /// moves to the commit. `None` for an answer no commit of this process made.
    pub(crate) _receipt: Option<std::sync::Arc<log::Receipt>>,
}

impl AppendResult {
    /// The document of `key` as this append's commit left it: `Some(None)` when the commit
    /// deleted it, `None` when this append did not touch it (or was a replay).
    pub fn row(&self, key: &RowKey) -> Option<Option<&serde_json::Value>> {
        self.rows.iter().find(|(k, _)| k == key).map(|(_, doc)| doc.as_ref())
    }
}

/// The last event of a chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Head {
    pub seq: u64,
    pub hash: [u8; 32],
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdempotencyRecord {
    pub request_hash: [u8; 32],
    pub first_seq: u64,
    pub last_seq: u64,
}

/// What the appender reads before deciding a batch.
#[derive(Clone, Debug, Default)]
pub struct PreReadQuery {
    pub tenants: Vec<TenantId>,
    pub streams: Vec<(TenantId, String)>,
    pub idempotency_keys: Vec<(TenantId, String)>,
}

#[derive(Clone, Debug, Default)]
pub struct PreRead {
    pub heads: HashMap<TenantId, Head>,
    pub stream_versions: HashMap<(TenantId, String), u64>,
    pub idempotency: HashMap<(TenantId, String), IdempotencyRecord>,
}

/// A batch decided, hashed and signed; the backend only writes it.
#[derive(Clone, Debug, Default)]
pub struct PreparedBatch {
    /// The chain heads the batch was built on. If any moved, the batch is stale.
    pub heads_before: Vec<(TenantId, Option<Head>)>,
    pub heads_after: Vec<(TenantId, Head)>,
    /// Events in commit order; `position.index` is set, `position.commit` is filled in by the
    /// backend.
    pub events: Vec<StoredEvent>,
    pub idempotency: Vec<(TenantId, String, IdempotencyRecord)>,
}

/// The final document of every projection row a commit touched (`None`: deleted).
pub type ProjectedRows = BTreeMap<RowKey, Option<serde_json::Value>>;

#[derive(Clone, Debug, PartialEq)]
pub enum CommitOutcome {
    Committed {
        commit: u64,
        /// The rows the commit's projection left.
        rows: ProjectedRows,
    },
    /// Another writer moved a chain head since the pre-read; nothing was written.
    Stale,
}

/// The key of one projection row. Every read model is a set of JSON documents keyed by
/// (tenant, kind, id), so one table serves them all and a rebuild can compare them exactly.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RowKey {
    pub tenant: String,
    pub kind: String,
    pub id: String,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    pub key: RowKey,
    pub doc: serde_json::Value,
}

/// A projection row as stored: its document still the JSON text, for a caller that decodes it
/// into a type of its own without building a [`serde_json::Value`] first.
#[derive(Clone, Debug, PartialEq)]
pub struct RawRow {
    pub key: RowKey,
    pub doc: String,
}

impl RawRow {
    /// The document decoded.
    pub fn parse(self) -> Result<Row> {
        let doc = serde_json::from_str(&self.doc).map_err(|e| Error::Storage(format!("projection doc: {e}")))?;
        Ok(Row { key: self.key, doc })
    }
}

/// Read models, as pure functions of events (implemented in `bc-projections`).
pub trait Projector: Send + Sync + 'static {
    /// The rows `event` changes.
    fn touches(&self, event: &StoredEvent, out: &mut Vec<RowKey>);
    /// The new document of `key` after `event`, given the current one; `None` deletes the row.
    fn apply(&self, key: &RowKey, current: Option<serde_json::Value>, event: &StoredEvent) -> Result<Option<serde_json::Value>>;
}

/// The rows `events` touch, each once, in first-touched order.
pub fn touched_rows(projector: &dyn Projector, events: &[StoredEvent]) -> Vec<RowKey> {
    let mut keys = Vec::new();
    let mut scratch = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for event in events {
        scratch.clear();
        projector.touches(event, &mut scratch);
        for key in scratch.drain(..) {
            if seen.insert(key.clone()) {
                keys.push(key);
            }
        }
    }
    keys
}

/// Folds `events` over the `current` documents; returns the final state of every touched row.
pub fn fold_projections(
    projector: &dyn Projector,
    events: &[StoredEvent],
    mut current: HashMap<RowKey, serde_json::Value>,
) -> Result<ProjectedRows> {
    let mut out = ProjectedRows::new();
    let mut scratch = Vec::new();
    for event in events {
        scratch.clear();
        projector.touches(event, &mut scratch);
        for key in scratch.drain(..) {
            let before = match out.get(&key) {
                Some(state) => state.clone(),
                None => current.remove(&key),
            };
            let after = projector.apply(&key, before, event)?;
            out.insert(key, after);
        }
    }
    Ok(out)
}

/// A page of projection rows.
#[derive(Clone, Debug)]
pub struct RowPage {
    pub rows: Vec<Row>,
}

/// Proof that the caller is inside `bc_core::store`: its field is private to this module tree,
/// so no other crate (and no other module of this one) can make one, and without one no
/// transaction opens. That is how only the [`Log`] appends.
///
/// Each check below fails to compile for the reason it names (its error code), not for another:
///
/// ```compile_fail,E0423
/// // Outside `bc_core::store` the token cannot be made (its field is private)…
/// let token = bc_core::store::WriteToken(());
/// ```
///
/// ```compile_fail,E0603
/// // …and the append commit, which takes an open transaction, is private to the store.
/// use bc_core::store::engine::commit;
/// ```
pub struct WriteToken(());

/// What every backend is: a name and a way to open a write transaction, for the algorithms of
/// `engine.rs` and `outbox.rs` alone.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// `sqlite` or `postgresql`.
    fn backend(&self) -> &'static str;
    /// Opens a write transaction (on SQLite, `BEGIN IMMEDIATE`: the write lock up front).
    #[doc(hidden)]
    async fn transaction(&self, token: WriteToken) -> Result<Box<dyn engine::Transaction + '_>>;
}

/// The log, read: events, chain heads, tenants, signing keys. Appending is the [`Log`]'s alone.
#[async_trait]
pub trait LogStore: Store {
    /// The chain heads, stream versions and idempotency records an append would be decided on.
    async fn preread(&self, query: &PreReadQuery) -> Result<PreRead>;
    /// Raw rows of one chain from `from_seq`, in `seq` order, unchecked (the auditor's view).
    async fn read_chain_rows(&self, tenant: TenantId, from_seq: u64, limit: u32) -> Result<Vec<EventRow>>;
    async fn read_stream_rows(&self, tenant: TenantId, stream: &str, after_version: u64, limit: u32) -> Result<Vec<EventRow>>;
    /// Rows after `after` in position order, of one tenant or all.
    async fn read_after_rows(&self, after: Position, tenant: Option<TenantId>, limit: u32) -> Result<Vec<EventRow>>;
    /// Which stream each event after `after` touched, in position order, of every tenant: what
    /// a follower that only marks what changed needs (the fleet view's catch-up), four narrow
    /// columns instead of the events' bytes.
    async fn read_after_touches(&self, after: Position, limit: u32) -> Result<Vec<StreamTouch>>;
    async fn event_row(&self, tenant: TenantId, id: EventId) -> Result<Option<EventRow>>;
    async fn heads(&self) -> Result<Vec<(TenantId, Head)>>;
    /// Every tenant with a chain head, an event or a projection row ([`TENANTS_SQL`]: the audit's
    /// list, which deleting a head must not shorten, and the level-triggered reconcilers' each
    /// pass).
    async fn tenants(&self) -> Result<Vec<TenantId>>;
    /// The number of the newest append transaction (0 for an empty log).
    async fn last_commit(&self) -> Result<u64>;

    async fn signing_key_put(&self, key_id: &str, public: &[u8; 32], at_ms: u64) -> Result<()>;
    async fn signing_keys(&self) -> Result<Vec<(String, Vec<u8>)>>;
}

/// The projection rows: read models, written by the append transaction and by a rebuild.
#[async_trait]
pub trait RowStore: Store {
    async fn row_get(&self, tenant: &str, kind: &str, id: &str) -> Result<Option<Row>>;
    /// The rows of these ids (at most [`ROWS_GET_MAX`]) of one kind of a tenant, ordered by
    /// id; an id without a row is left out. One statement where [`RowStore::row_get`] would
    /// take one each.
    async fn rows_get(&self, tenant: &str, kind: &str, ids: &[&str]) -> Result<Vec<Row>> {
        self.rows_get_raw(tenant, kind, ids).await?.into_iter().map(RawRow::parse).collect()
    }
    /// [`RowStore::rows_get`] with the documents as stored (JSON text), for a caller that
    /// decodes them into its own type at once (the fleet view).
    async fn rows_get_raw(&self, tenant: &str, kind: &str, ids: &[&str]) -> Result<Vec<RawRow>>;
    /// Rows of one kind by id across tenants (API keys are found by their id alone).
    async fn row_find(&self, kind: &str, id: &str) -> Result<Option<Row>>;
    /// A tenant's rows of one kind in id order, after `after_id`, at most `limit`.
    async fn row_list(&self, tenant: &str, kind: &str, after_id: Option<&str>, limit: u32) -> Result<Vec<Row>> {
        self.row_list_raw(tenant, kind, after_id, limit).await?.into_iter().map(RawRow::parse).collect()
    }
    /// [`RowStore::row_list`] with the documents as stored (JSON text).
    async fn row_list_raw(&self, tenant: &str, kind: &str, after_id: Option<&str>, limit: u32) -> Result<Vec<RawRow>>;
    /// A tenant's row of one kind with the greatest id (in byte order, as [`RowStore::row_list`]
    /// pages): one row read, however many the kind holds (the newest checkpoint, whose id is its
    /// zero-padded size, for every checkpoint and tile an auditor fetches).
    async fn row_last(&self, tenant: &str, kind: &str) -> Result<Option<Row>>;
    async fn rows_all(&self) -> Result<Vec<Row>>;
    /// Replaces every projection row, if the log is still at `at_commit`; returns false if it
    /// moved (the caller folds again).
    async fn rows_replace_all(&self, rows: &[Row], at_commit: u64) -> Result<bool> {
        let mut tx = self.transaction(WriteToken(())).await?;
        engine::rows_replace_all(&mut *tx, rows, at_commit).await
    }
}

/// Ids one [`RowStore::rows_get`] reads at most.
pub const ROWS_GET_MAX: usize = 500;

/// Refuses a [`RowStore::rows_get`] of more than [`ROWS_GET_MAX`] ids.
pub(crate) fn check_rows_get(ids: &[&str]) -> Result<()> {
    if ids.len() > ROWS_GET_MAX {
        return Err(Error::invalid(format!("rows_get reads at most {ROWS_GET_MAX} ids at once, not {}", ids.len())));
    }
    Ok(())
}

/// Secrets re-sealed per read of the table.
pub const RESEAL_ROWS_PER_READ: u32 = 500;

/// Write-only secrets (webhook signing keys, the hashes of tokens' secrets): not part of the
/// log, nor of any projection. Sealed at rest under the deployment's data key once the process
/// has set one ([`SecretStore::set_data_keys`], `crate::sealing`): `secret_put` seals,
/// `secret_get` opens; the backends store and return the sealed text (`*_raw`).
#[async_trait]
pub trait SecretStore: Store {
    async fn secret_put_raw(&self, tenant: TenantId, id: &str, stored: &str, now_ms: u64) -> Result<()>;
    async fn secret_get_raw(&self, tenant: TenantId, id: &str) -> Result<Option<String>>;
    async fn secret_delete(&self, tenant: TenantId, id: &str) -> Result<()>;
    /// How many secrets the tenant has stored (operators and tests: a bound is checked by it).
    async fn secrets_count(&self, tenant: TenantId) -> Result<u64>;
    /// Rows as stored, `(tenant, id, stored)` in key order after `after`: what re-sealing walks.
    async fn secrets_page_raw(&self, after: Option<(String, String)>, limit: u32) -> Result<Vec<(String, String, String)>>;
    /// Replaces a row's stored text if it is still `old`; whether it did.
    async fn secret_replace_raw(&self, tenant: &str, id: &str, old: &str, new: &str) -> Result<bool>;
    /// The keys secrets are sealed and opened with (`None`: stored as given, as in tests that
    /// build a store by hand).
    fn data_keys(&self) -> Option<std::sync::Arc<crate::sealing::DataKeys>>;
    fn set_data_keys(&self, keys: std::sync::Arc<crate::sealing::DataKeys>);

    async fn secret_put(&self, tenant: TenantId, id: &str, value: &str, now_ms: u64) -> Result<()> {
        let stored = match self.data_keys() {
            Some(keys) => keys.seal(tenant, id, value)?,
            None => value.to_owned(),
        };
        self.secret_put_raw(tenant, id, &stored, now_ms).await
    }

    async fn secret_get(&self, tenant: TenantId, id: &str) -> Result<Option<String>> {
        let Some(stored) = self.secret_get_raw(tenant, id).await? else { return Ok(None) };
        match self.data_keys() {
            Some(keys) => keys.open(tenant, id, &stored).map(Some),
            None if stored.starts_with(crate::sealing::SEALED_PREFIX) => {
                Err(Error::Internal(format!("secret {id} is sealed and this process has no data key")))
            }
            None => Ok(Some(stored)),
        }
    }

    /// Seals every row not yet sealed under the current data key (rows written before sealing,
    /// or under the previous key during a rotation); returns how many it re-sealed. Each row is
    /// replaced only if unchanged since it was read, so a concurrent write is never lost.
    async fn secrets_reseal(&self) -> Result<u64> {
        let keys = self.data_keys().ok_or_else(|| Error::Internal("re-sealing secrets needs a data key".into()))?;
        let mut after = None;
        let mut resealed = 0;
        loop {
            let page = self.secrets_page_raw(after.clone(), RESEAL_ROWS_PER_READ).await?;
            let full = page.len() == RESEAL_ROWS_PER_READ as usize;
            for (tenant, id, stored) in &page {
                if crate::sealing::sealed_key_id(stored) == Some(keys.current.id()) {
                    continue;
                }
                let tenant_id: TenantId = tenant.parse()?;
                let value = keys.open(tenant_id, id, stored)?;
                let sealed = keys.seal(tenant_id, id, &value)?;
                if self.secret_replace_raw(tenant, id, stored, &sealed).await? {
                    resealed += 1;
                }
            }
            after = page.last().map(|(t, i, _)| (t.clone(), i.clone()));
            if !full {
                return Ok(resealed);
            }
        }
    }
}

/// The umbrella every caller names (`Arc<dyn EventStore>`): the log, the projection rows, the
/// outbox and the secrets of one database, and its schema.
#[async_trait]
pub trait EventStore: LogStore + RowStore + outbox::OutboxStore + SecretStore + status::StatusStore + lease::LeaseStore {
    /// This backend's migrations, oldest first.
    fn migrations(&self) -> &'static [Migration];
    /// The newest migration applied; `None` when none is (or there is no migrations table).
    async fn schema_version(&self) -> Result<Option<u64>>;

    /// Applies every migration not yet applied, recording `now_ms` as when. Safe to run
    /// concurrently and repeatedly.
    async fn migrate_at(&self, now_ms: u64) -> Result<Vec<String>> {
        let mut tx = self.transaction(WriteToken(())).await?;
        engine::migrate(&mut *tx, self.migrations(), now_ms).await
    }
    /// [`EventStore::migrate_at`] the system clock's now: for the composition root (`migrate`,
    /// `dev`), where the real clock is the input.
    async fn migrate(&self) -> Result<Vec<String>> {
        self.migrate_at(crate::clock::Clock::now_ms(&crate::clock::SystemClock)).await
    }
    /// Fails with a hint when the schema is older than this binary.
    async fn check_schema(&self) -> Result<()> {
        engine::schema_check(self.schema_version().await?, self.migrations())
    }
    /// What `doctor` reads of the database server itself: its clock and the settings that
    /// matter. An embedded database has neither (it is this host's clock).
    async fn server_facts(&self) -> Result<ServerFacts> {
        Ok(ServerFacts::default())
    }
}

/// The database server's clock and settings (`EventStore::server_facts`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServerFacts {
    /// The server's clock, ms since the Unix epoch, read at the call.
    pub now_ms: Option<u64>,
    /// `synchronous_commit`, `max_connections`, … as the server reports them.
    pub settings: Vec<(String, String)>,
}

/// Reads and checks stored rows (hash and columns; signatures are the chain verifier's job).
pub fn decode_rows(rows: Vec<EventRow>) -> Result<Vec<StoredEvent>> {
    rows.into_iter().map(decode_row).collect()
}

/// [`decode_rows`] for one row.
pub fn decode_row(row: EventRow) -> Result<StoredEvent> {
    let (tenant, seq) = (row.tenant.clone(), row.seq);
    row.decode().map_err(|what| {
        tracing::error!(%tenant, seq, %what, "stored event does not verify");
        Error::Corrupt { tenant, seq, what }
    })
}

/// Folds the whole log into fresh projection rows and swaps them in.
pub async fn rebuild_projections(store: &dyn EventStore, projector: &dyn Projector) -> Result<(u64, usize)> {
    const REBUILD_ATTEMPTS_MAX: usize = 5;
    for _ in 0..REBUILD_ATTEMPTS_MAX {
        let at_commit = store.last_commit().await?;
        let mut state: HashMap<RowKey, serde_json::Value> = HashMap::new();
        let mut after = Position::START;
        let mut events_folded = 0u64;
        loop {
            let page = decode_rows(store.read_after_rows(after, None, READ_ROWS_MAX).await?)?;
            let Some(last) = page.last() else { break };
            after = last.position;
            let page: Vec<_> = page.into_iter().filter(|e| e.position.commit <= at_commit).collect();
            if page.is_empty() {
                break;
            }
            events_folded += page.len() as u64;
            let keys = touched_rows(projector, &page);
            let current = keys.iter().filter_map(|k| state.remove(k).map(|v| (k.clone(), v))).collect();
            for (key, doc) in fold_projections(projector, &page, current)? {
                if let Some(doc) = doc {
                    state.insert(key, doc);
                }
            }
        }
        let mut rows: Vec<Row> = state.into_iter().map(|(key, doc)| Row { key, doc }).collect();
        rows.sort_by(|a, b| a.key.cmp(&b.key));
        if store.rows_replace_all(&rows, at_commit).await? {
            return Ok((events_folded, rows.len()));
        }
    }
    Err(Error::Unavailable("the log kept moving during the rebuild; try again".into()))
}

/// A result row, read by column index: lets both backends decode events, heads, projection
/// rows, work items and attempts with one piece of code.
pub(crate) trait Columns {
    fn text(&self, i: usize) -> Result<String>;
    fn opt_text(&self, i: usize) -> Result<Option<String>>;
    fn int(&self, i: usize) -> Result<i64>;
    fn opt_int(&self, i: usize) -> Result<Option<i64>>;
    fn bytes(&self, i: usize) -> Result<Vec<u8>>;
}

/// `impl Columns` for a backend's row type, whose `try_get(index)` infers the column's Rust
/// type (sqlx's and tokio-postgres's both do).
macro_rules! columns_by_try_get {
    ($row:ty) => {
        impl $crate::store::Columns for $row {
            fn text(&self, i: usize) -> $crate::error::Result<String> {
                Ok(self.try_get(i)?)
            }
            fn opt_text(&self, i: usize) -> $crate::error::Result<Option<String>> {
                Ok(self.try_get(i)?)
            }
            fn int(&self, i: usize) -> $crate::error::Result<i64> {
                Ok(self.try_get(i)?)
            }
            fn opt_int(&self, i: usize) -> $crate::error::Result<Option<i64>> {
                Ok(self.try_get(i)?)
            }
            fn bytes(&self, i: usize) -> $crate::error::Result<Vec<u8>> {
                Ok(self.try_get(i)?)
            }
        }
    };
}
pub(crate) use columns_by_try_get;

/// [`LogStore::tenants`] on both backends: each table's tenants found by its primary key's first
/// column one at a time (the next tenant after the last: a loose index scan), so the cost is the
/// number of tenants, not of events. `SELECT DISTINCT tenant_id FROM events` read the whole key,
/// 40 ms at 1,000,000 events against 0.05 ms so, and three reconcilers list the tenants every
/// 0.5–1 s.
pub(crate) const TENANTS_SQL: &str = "SELECT tenant_id FROM chain_heads \
     UNION SELECT t FROM (WITH RECURSIVE s(t) AS (SELECT (SELECT min(tenant_id) FROM events) \
         UNION ALL SELECT (SELECT min(tenant_id) FROM events WHERE tenant_id > s.t) FROM s WHERE s.t IS NOT NULL) \
         SELECT t FROM s WHERE t IS NOT NULL) e \
     UNION SELECT t FROM (WITH RECURSIVE s(t) AS (SELECT (SELECT min(tenant_id) FROM projections) \
         UNION ALL SELECT (SELECT min(tenant_id) FROM projections WHERE tenant_id > s.t) FROM s WHERE s.t IS NOT NULL) \
         SELECT t FROM s WHERE t IS NOT NULL) p \
     ORDER BY 1";

/// This build's migrations for one backend, from `schema/<dialect>/`; the list is the same for
/// every backend (each file has one counterpart per dialect).
macro_rules! migrations_of {
    ($dialect:literal) => {
        &[
            $crate::store::Migration {
                version: 1,
                name: "log",
                sql: include_str!(concat!("../../../schema/", $dialect, "/0001_log.sql")),
            },
            $crate::store::Migration {
                version: 2,
                name: "outbox",
                sql: include_str!(concat!("../../../schema/", $dialect, "/0002_outbox.sql")),
            },
            $crate::store::Migration {
                version: 3,
                name: "outbox_prune",
                sql: include_str!(concat!("../../../schema/", $dialect, "/0003_outbox_prune.sql")),
            },
            $crate::store::Migration {
                version: 4,
                name: "reconciler_passes",
                sql: include_str!(concat!("../../../schema/", $dialect, "/0004_reconciler_passes.sql")),
            },
            $crate::store::Migration {
                version: 5,
                name: "events_by_tenant_position",
                sql: include_str!(concat!("../../../schema/", $dialect, "/0005_events_by_tenant_position.sql")),
            },
            $crate::store::Migration {
                version: 6,
                name: "node_leases",
                sql: include_str!(concat!("../../../schema/", $dialect, "/0006_node_leases.sql")),
            },
            $crate::store::Migration {
                version: 7,
                name: "work_items_fillfactor",
                sql: include_str!(concat!("../../../schema/", $dialect, "/0007_work_items_fillfactor.sql")),
            },
            $crate::store::Migration {
                version: 8,
                name: "projections_byte_order",
                sql: include_str!(concat!("../../../schema/", $dialect, "/0008_projections_byte_order.sql")),
            },
            $crate::store::Migration {
                version: 9,
                name: "node_lease_holders",
                sql: include_str!(concat!("../../../schema/", $dialect, "/0009_node_lease_holders.sql")),
            },
        ]
    };
}
pub(crate) use migrations_of;

/// Where one event is and which stream it touched ([`LogStore::read_after_touches`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamTouch {
    pub tenant: String,
    pub stream: String,
    pub commit: u64,
    pub index: u32,
}

/// The columns a [`StreamTouch`] is read from, in its order.
pub(crate) const TOUCH_COLUMNS: &str = "tenant_id, stream, commit_no, commit_index";

pub(crate) fn touch_decode(row: &(impl Columns + ?Sized)) -> Result<StreamTouch> {
    Ok(StreamTouch {
        tenant: row.text(0)?,
        stream: row.text(1)?,
        commit: to_u64(row.int(2)?)?,
        index: u32::try_from(row.int(3)?).map_err(|_| Error::Storage("commit_index out of range".into()))?,
    })
}

/// The columns an event is read from, in [`event_row_decode`]'s order (a backend may cast one,
/// keeping the order).
pub(crate) const EVENT_COLUMNS: &str =
    "tenant_id, seq, id, stream, version, type, commit_no, commit_index, canonical, hash, sig, key_id";

pub(crate) fn event_row_decode(row: &(impl Columns + ?Sized)) -> Result<EventRow> {
    Ok(EventRow {
        tenant: row.text(0)?,
        seq: to_u64(row.int(1)?)?,
        id: row.text(2)?,
        stream: row.text(3)?,
        version: to_u64(row.int(4)?)?,
        event_type: row.text(5)?,
        commit: to_u64(row.int(6)?)?,
        index: u32::try_from(row.int(7)?).map_err(|_| Error::Storage("commit_index out of range".into()))?,
        canonical: row.bytes(8)?,
        hash: row.bytes(9)?,
        sig: row.bytes(10)?,
        key_id: row.text(11)?,
    })
}

/// A projection row from `tenant_id, kind, id, doc`.
pub(crate) fn projection_row_decode(row: &(impl Columns + ?Sized)) -> Result<Row> {
    raw_row_decode(row)?.parse()
}

/// [`projection_row_decode`] leaving the document as its JSON text.
pub(crate) fn raw_row_decode(row: &(impl Columns + ?Sized)) -> Result<RawRow> {
    Ok(RawRow { key: RowKey { tenant: row.text(0)?, kind: row.text(1)?, id: row.text(2)? }, doc: row.text(3)? })
}

/// A stream's version from `tenant_id, stream, MAX(version)` (`None`: no such stream).
pub(crate) fn stream_version_decode(row: &(impl Columns + ?Sized)) -> Result<Option<((TenantId, String), u64)>> {
    let Some(version) = row.opt_int(2)? else { return Ok(None) };
    Ok(Some(((row.text(0)?.parse()?, row.text(1)?), to_u64(version)?)))
}

/// An idempotency record from `tenant_id, key, request_hash, first_seq, last_seq`.
pub(crate) fn idempotency_decode(row: &(impl Columns + ?Sized)) -> Result<((TenantId, String), IdempotencyRecord)> {
    Ok(((row.text(0)?.parse()?, row.text(1)?), IdempotencyRecord::from_columns(row.bytes(2)?, row.int(3)?, row.int(4)?)?))
}

/// A chain head from `tenant_id, seq, hash`.
pub(crate) fn head_decode(row: &(impl Columns + ?Sized)) -> Result<(TenantId, Head)> {
    Ok((row.text(0)?.parse()?, Head { seq: to_u64(row.int(1)?)?, hash: hash32(row.bytes(2)?)? }))
}

/// Converts an unsigned count to SQL's signed 64-bit integer, refusing what would wrap.
pub(crate) fn to_i64(value: u64) -> Result<i64> {
    i64::try_from(value).map_err(|_| Error::Internal(format!("{value} does not fit a signed 64-bit column")))
}

/// A stored 32-byte hash column.
pub(crate) fn hash32(bytes: Vec<u8>) -> Result<[u8; 32]> {
    <[u8; 32]>::try_from(bytes).map_err(|_| Error::Storage("stored hash is not 32 bytes".into()))
}

impl IdempotencyRecord {
    /// From the `request_hash, first_seq, last_seq` columns.
    pub(crate) fn from_columns(request_hash: Vec<u8>, first_seq: i64, last_seq: i64) -> Result<Self> {
        Ok(Self { request_hash: hash32(request_hash)?, first_seq: to_u64(first_seq)?, last_seq: to_u64(last_seq)? })
    }
}

pub(crate) fn to_u64(value: i64) -> Result<u64> {
    u64::try_from(value).map_err(|_| Error::Storage(format!("negative value {value} in an unsigned column")))
}

pub(crate) fn to_u32(value: i64) -> Result<u32> {
    u32::try_from(value).map_err(|_| Error::Storage(format!("value {value} out of range for a 32-bit column")))
}
