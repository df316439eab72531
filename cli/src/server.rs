//! The operator commands that open the database directly: `dev`, `serve`, `migrate`,
//! `pki show`, `pki rotate-ssh-ca`, `projections rebuild`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bc_core::clock::{Clock, SystemClock};
use bc_core::keys::{LogKey, write_secret_file};
use bc_core::store::postgres::PostgresStore;
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{EventStore, Log, rebuild_projections};
use bc_core::webhook::EndpointPolicy;
use bc_gateway::AppState;
use bc_projections::Projections;
use bc_reconcilers::outbox::{RetryPolicy, RunnerConfig};
use bc_reconcilers::registry::{self, REGISTRY, Registration};
use serde_json::{Value, json};

use crate::client::CliError;

pub const SQLITE_FILE: &str = "better-compute.sqlite3";
pub const LOG_KEY_FILE: &str = "log.key";
pub const ADMIN_TOKEN_FILE: &str = "admin.token";

/// Where an operator command finds its database.
pub enum Database {
    Sqlite(PathBuf),
    Postgres(String),
}

impl Database {
    pub fn from_args(data_dir: &Path, database_url: Option<&str>) -> Self {
        match database_url {
            Some(url) => Database::Postgres(url.to_owned()),
            None => Database::Sqlite(data_dir.join(SQLITE_FILE)),
        }
    }

    pub async fn open(&self) -> Result<Arc<dyn EventStore>, CliError> {
        Ok(match self {
            Database::Sqlite(path) => {
                if let Some(dir) = path.parent() {
                    create_private_dir(dir)?;
                }
                Arc::new(SqliteStore::open(path).await.map_err(|e| {
                    CliError::new("UNAVAILABLE", format!("cannot open {}: {}", path.display(), e.public_message()))
                })?)
            }
            Database::Postgres(url) => {
                if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
                    // Never echo the URL: it may carry a password.
                    let scheme = url.split_once("://").map(|(s, _)| s).unwrap_or("(none)");
                    return Err(CliError::usage(format!("--database-url must be postgres://…, not a {scheme:?} URL")));
                }
                Arc::new(PostgresStore::connect(url).await?)
            }
        })
    }

    pub fn describe(&self) -> String {
        match self {
            Database::Sqlite(path) => format!("{} (sqlite)", path.display()),
            Database::Postgres(_) => "postgresql (--database-url)".into(),
        }
    }
}

pub(crate) fn create_private_dir(dir: &Path) -> Result<(), CliError> {
    use std::os::unix::fs::DirBuilderExt;
    if dir.as_os_str().is_empty() || dir.is_dir() {
        return Ok(());
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| CliError::new("INTERNAL", format!("cannot create {}: {e}", dir.display())))
}

pub async fn migrate(db: &Database) -> Result<Value, CliError> {
    let store = db.open().await?;
    let applied = store.migrate_at(SystemClock.now_ms()).await?;
    Ok(json!({ "backend": store.backend(), "applied": applied }))
}

/// The public line of the deployment's SSH user CA, beside the log key: what `pki show` prints
/// (the CA itself is in the database, sealed).
pub const SSH_USER_CA_FILE: &str = "ssh_user_ca.pub";

/// The deployment's SSH user CAs, the first made and stored (sealed under the data key) at the
/// first start; the current one's public line is written to [`SSH_USER_CA_FILE`].
async fn ssh_user_ca(log: &Log, data_dir: &Path) -> Result<bc_gateway::ssh_ca::SshUserCaRing, CliError> {
    let (ring, created) = bc_gateway::ssh_ca::SshUserCaRing::open(log.store.clone(), log.clock.clone()).await?;
    let current = ring.current().await?;
    if created {
        tracing::info!(fingerprint = %current.fingerprint(), "created the SSH user CA");
    }
    write_ssh_user_ca_file(data_dir, &current.public_openssh())?;
    Ok(ring)
}

fn write_ssh_user_ca_file(data_dir: &Path, line: &str) -> Result<(), CliError> {
    let path = data_dir.join(SSH_USER_CA_FILE);
    std::fs::write(&path, format!("{line}\n"))
        .map_err(|e| CliError::new("INTERNAL", format!("cannot write {}: {e}", path.display())))
}

/// `pki show`: the log key's id, pin and vkey, the SSH user CAs: the current one
/// (`sshUserCa`) and those replaced still in their grace (`sshUserCaInGrace`, with its end), the
/// node CA's pins and the join keys' (`joinSigningPin`, `joinEncryptionPin`). The
/// CAs come from the log when this directory's database (or `--database-url`) is there to
/// read (public keys only: no data key is needed), else from [`SSH_USER_CA_FILE`].
pub async fn pki_show(db: &Database, data_dir: &Path, deployment: &str) -> Result<Value, CliError> {
    use base64::Engine;
    let path = data_dir.join(LOG_KEY_FILE);
    if !path.exists() {
        return Err(CliError::new("PKI_NOT_FOUND", format!("no log key at {}", path.display()))
            .hint("run `better-compute dev` once, or pass the --data-dir that serve uses"));
    }
    let key = LogKey::load(&path)?;
    let mut shown = json!({
        "keyId": key.key_id(),
        "pin": key.pin(),
        "vkey": bc_core::audit::vkey_of(&key, deployment)?.encode(),
        "publicKey": base64::engine::general_purpose::STANDARD.encode(key.public().as_bytes()),
        "algorithm": "ed25519",
    });
    shown.as_object_mut().expect("an object").extend(ssh_user_ca_shown(db, data_dir).await?);
    // The join keys' pins, as the server wrote them beside the log key: what `bcd join --server`
    // takes as --join-signing-pin and --join-encryption-pin.
    let join_keys_path = data_dir.join(bc_gateway::join_keys::JOIN_KEYS_FILE);
    if let Ok(text) = std::fs::read_to_string(&join_keys_path)
        && let Ok(public) = serde_json::from_str::<Value>(&text)
    {
        shown["joinSigningPin"] = public["joinSigningPin"].clone();
        shown["joinEncryptionPin"] = public["joinEncryptionPin"].clone();
    }
    // The node CA's certificates, as the server wrote them beside the log key: the current one
    // first, then each replaced one still in its overlap after `pki renew-ca`.
    let node_ca_path = data_dir.join(bc_gateway::node_ca::NODE_CA_FILE);
    if let Ok(pem) = std::fs::read(&node_ca_path) {
        use rustls::pki_types::pem::PemObject;
        let pins: Vec<String> = rustls::pki_types::CertificateDer::pem_slice_iter(&pem)
            .filter_map(|c| c.ok().and_then(|c| bc_gateway::agents::tls::spki_pin(&c).ok()))
            .collect();
        shown["nodeCa"] = json!({
            "pin": pins.first(),
            "previousPins": pins.get(1..).unwrap_or_default(),
            "certificate": node_ca_path.display().to_string(),
        });
    }
    Ok(shown)
}

/// `pki show`'s SSH user CA fields (see [`pki_show`]).
async fn ssh_user_ca_shown(db: &Database, data_dir: &Path) -> Result<serde_json::Map<String, Value>, CliError> {
    let mut state = bc_projections::decide::ssh_cert::SshCaState::default();
    let readable = match db {
        Database::Sqlite(path) => path.exists(),
        Database::Postgres(_) => true,
    };
    if readable {
        let store = db.open().await?;
        store.check_schema().await?;
        bc_gateway::ssh_ca::read_rotations(&*store, &mut state).await?;
    }
    // Before the first rotation the log holds no CA key: the file the first start wrote does.
    let current = match &state.current {
        Some(current) => Some(current.public_key.clone()),
        None => std::fs::read_to_string(data_dir.join(SSH_USER_CA_FILE)).ok().map(|line| line.trim().to_owned()),
    };
    let fingerprint = current
        .as_deref()
        .and_then(|line| ssh_key::PublicKey::from_openssh(line).ok())
        .map(|key| key.fingerprint(ssh_key::HashAlg::Sha256).to_string());
    let now_ms = SystemClock.now_ms();
    let in_grace: Vec<Value> = state
        .in_grace_at(now_ms)
        .map(|k| {
            json!({
                "publicKey": k.public_key,
                "fingerprint": k.fingerprint,
                "graceEndsAtMs": k.grace_ends_at_ms,
                "graceEnds": bc_core::clock::rfc3339_ms(k.grace_ends_at_ms),
            })
        })
        .collect();
    let mut shown = serde_json::Map::new();
    // Absent before the first start of dev or serve with this directory.
    shown.insert("sshUserCa".into(), json!(current));
    shown.insert("sshUserCaFingerprint".into(), json!(fingerprint));
    shown.insert("sshUserCaGeneration".into(), json!(state.generation()));
    shown.insert("sshUserCaInGrace".into(), Value::Array(in_grace));
    Ok(shown)
}

/// `pki rotate-ssh-ca`: a new SSH user CA (sealed under the data key), `ssh_ca.rotated` in the
/// log; running servers sign with it from their next certificate and send it to their agents
/// within `SSH_CA_REFRESH_MS`, beside the replaced one until `grace_ms` has passed.
pub async fn rotate_ssh_ca(db: &Database, data_dir: &Path, data_key_path: &Path, grace_ms: u64) -> Result<Value, CliError> {
    let store = db.open().await?;
    store.check_schema().await?;
    if !data_key_path.exists() {
        return Err(CliError::new("DATA_KEY_NOT_FOUND", format!("no data key at {}", data_key_path.display()))
            .hint("the new CA is sealed under it: pass the --data-dir (or --data-key-file) that dev or serve uses"));
    }
    check_log_key(&*store, data_dir).await?;
    seal_secrets(&*store, data_key_path, false).await?;
    let key_path = data_dir.join(LOG_KEY_FILE);
    if !key_path.exists() {
        return Err(CliError::new("PKI_NOT_FOUND", format!("no log key at {}", key_path.display()))
            .hint("the rotation is appended to the log: pass the --data-dir that dev or serve uses"));
    }
    let key = Arc::new(LogKey::load(&key_path)?);
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let log = Log::open(store.clone(), Arc::new(Projections), key, clock.clone()).await?;
    let (ring, _) = bc_gateway::ssh_ca::SshUserCaRing::open(store, clock).await?;
    let rotation = ring.rotate(&log, grace_ms).await?;
    let rotated = &rotation.rotated;
    write_ssh_user_ca_file(data_dir, &rotated.public_key)?;
    Ok(json!({
        "generation": rotated.generation,
        "publicKey": rotated.public_key,
        "fingerprint": rotated.fingerprint,
        "previousFingerprint": rotated.previous_fingerprint,
        "graceEndsAtMs": rotated.grace_ends_at_ms,
        "graceEnds": bc_core::clock::rfc3339_ms(rotated.grace_ends_at_ms),
        "rotationSeq": rotation.seq,
        "previousKeyDeleted": rotation.previous_key_deleted,
        "next": format!(
            "servers sign with the new CA from now on, and their agents trust it within {} s; they trust the previous one until graceEnds",
            bc_gateway::ssh_ca::SSH_CA_REFRESH_MS / 1000
        ),
    }))
}

pub async fn projections_rebuild(db: &Database) -> Result<Value, CliError> {
    let store = db.open().await?;
    store.check_schema().await?;
    let started = std::time::Instant::now();
    eprintln!("rebuilding projections from the log…");
    let (events, rows) = rebuild_projections(&*store, &Projections).await?;
    Ok(json!({ "events": events, "rows": rows, "elapsedMs": started.elapsed().as_millis() as u64 }))
}

/// How the reconcilers run: in `dev`/`serve` (unless turned off) and in `reconcile`.
#[derive(Clone, Debug)]
pub struct ConsumerOptions {
    pub policy: EndpointPolicy,
    /// Where BMCs may be reached (`--bmc-allow-network`): the metal reconciler's connector and
    /// enrollment's check.
    pub bmc_networks: bc_bmc::BmcNetworks,
    pub delivery_timeout_ms: u64,
    pub lease_ms: u64,
    pub retry: RetryPolicy,
    pub concurrency: usize,
    pub poll_ms: u64,
    /// How often the level-triggered reconcilers (reservations) look again without a wake-up.
    pub tick_ms: u64,
    /// The length of the usage windows (`--usage-window`).
    pub usage_window_ms: u64,
}

impl ConsumerOptions {
    fn runner(&self) -> RunnerConfig {
        let mut config = RunnerConfig::new(Arc::new(SystemClock));
        config.lease_ms = self.lease_ms;
        config.time_limit_ms = self.delivery_timeout_ms;
        config.retry = self.retry;
        config.concurrency = self.concurrency;
        config.poll_ms = self.poll_ms;
        config
    }
}

/// What the registry builds the reconcilers from, in a process of this binary.
fn reconciler_inputs(
    store: Arc<dyn EventStore>,
    log: Option<Arc<Log>>,
    wake: Option<tokio::sync::watch::Receiver<u64>>,
    options: &ConsumerOptions,
    sealing: Option<registry::Sealing>,
    witnesses: Vec<bc_reconcilers::witnesses::Witness>,
) -> registry::Inputs {
    registry::Inputs {
        store,
        log,
        clock: Arc::new(SystemClock),
        wake,
        reservations_tick_ms: options.tick_ms,
        outbox: Some(options.runner()),
        webhook_policy: options.policy,
        bmc: Some(Arc::new(bc_bmc::RedfishConnector { networks: options.bmc_networks.clone() })),
        sealing,
        witnesses,
        usage_window_ms: options.usage_window_ms,
    }
}

/// Starts `chosen` from the registry, each until `shutdown` turns true; returns the names
/// started (one with nothing to do, as `witnesses` without a witness, is not).
fn start_reconcilers(
    chosen: &[&'static Registration],
    inputs: &registry::Inputs,
    shutdown: &tokio::sync::watch::Receiver<bool>,
    tasks: &mut Vec<tokio::task::JoinHandle<()>>,
) -> Result<Vec<&'static str>, CliError> {
    let mut started = Vec::new();
    for registration in chosen {
        if let Some(task) = registration.start(inputs, shutdown.clone())? {
            tasks.push(task);
            started.push(registration.name);
        }
    }
    Ok(started)
}

/// `--witness NAME=URL+VKEY…`, at most `WITNESSES_MAX`.
fn parse_witnesses(witnesses: &[String]) -> Result<Vec<bc_reconcilers::witnesses::Witness>, CliError> {
    if witnesses.len() > bc_core::witness::WITNESSES_MAX {
        return Err(CliError::usage(format!("at most {} --witness", bc_core::witness::WITNESSES_MAX)));
    }
    witnesses
        .iter()
        .map(|w| bc_reconcilers::witnesses::Witness::parse(w).map_err(|e| CliError::usage(format!("--witness: {e}"))))
        .collect()
}

/// `reconcile --only NAME…`: runs reconcilers of the registry (without `--only`, all of them)
/// as their own process until Ctrl-C/SIGTERM. The webhook consumer needs the database and the
/// data key its signing secrets are sealed under (`data.key` in `--data-dir`); the reconcilers
/// that append also need the log key in `--data-dir`. With `metrics_listen`, the process's
/// metrics (its passes, its outbox items, its appends, and what the database counts) are served
/// there.
#[allow(clippy::too_many_arguments)]
pub async fn reconcile(
    db: &Database,
    data_dir: &Path,
    data_key_path: &Path,
    only: &[String],
    options: &ConsumerOptions,
    sealing: &crate::flags::Sealing,
    witnesses: &[String],
    metrics_listen: Option<&str>,
) -> Result<(), CliError> {
    let chosen: Vec<&'static Registration> = if only.is_empty() {
        REGISTRY.iter().collect()
    } else {
        only.iter()
            .map(|name| {
                registry::find(name).ok_or_else(|| {
                    CliError::usage(format!("--only {name:?} is not a reconciler"))
                        .hint(format!("reconcilers: {}", registry::NAMES.join(", ")))
                })
            })
            .collect::<Result<_, _>>()?
    };
    let runs = |name: &str| chosen.iter().any(|r| r.name == name);
    if runs(bc_reconcilers::checkpoints::NAME) && sealing.checkpoint_interval == 0 {
        return Err(CliError::usage("--only checkpoints needs a --checkpoint-interval other than 0"));
    }
    let witnesses = parse_witnesses(witnesses)?;
    if !only.is_empty() && runs(bc_reconcilers::witnesses::NAME) && witnesses.is_empty() {
        return Err(CliError::usage("--only witnesses needs a --witness NAME=URL+VKEY"));
    }
    let store = db.open().await?;
    store.check_schema().await?;
    // The webhook consumer opens signing secrets: sealed under the data key.
    seal_secrets(&*store, data_key_path, false).await?;
    let mut log = None;
    if chosen.iter().any(|r| r.appends) {
        let key_path = data_dir.join(LOG_KEY_FILE);
        if !key_path.exists() {
            let appenders: Vec<&str> = REGISTRY.iter().filter(|r| r.appends).map(|r| r.name).collect();
            return Err(CliError::new("PKI_NOT_FOUND", format!("no log key at {}", key_path.display()))
                .hint(format!("the {} reconcilers append: pass the --data-dir that dev or serve uses", appenders.join(", "))));
        }
        check_log_key(&*store, data_dir).await?;
        let key = Arc::new(LogKey::load(&key_path)?);
        log = Some(Arc::new(Log::open(store.clone(), Arc::new(Projections), key, Arc::new(SystemClock)).await?));
    }
    let sealing = match runs(bc_reconcilers::checkpoints::NAME) {
        true => {
            let deployment = sealing.deployment.deployment.clone();
            let trust = crate::audit::local_trust(data_dir, &deployment)?;
            Some(registry::Sealing { interval_s: sealing.checkpoint_interval, deployment, trust })
        }
        false => None,
    };
    let metrics_listener = bind_metrics(metrics_listen).await?;
    let metrics = Arc::new(bc_gateway::metrics::Metrics::new(store.backend()));
    if let Some(log) = &log {
        log.stats.observe(metrics.log_observer());
    }
    // Before the reconcilers start, so their first passes are counted.
    bc_reconcilers::driver::observe(Arc::new(PassMetrics(metrics.clone())));
    let inputs = reconciler_inputs(store.clone(), log, None, options, sealing, witnesses);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut tasks = Vec::new();
    let started = start_reconcilers(&chosen, &inputs, &stopped, &mut tasks)?;
    println!("better-compute reconciling: {}", started.join(", "));
    println!("  database:  {}", db.describe());
    if let Some((listener, addr)) = metrics_listener {
        println!("  metrics:   http://{addr}/metrics");
        let mut until = stopped.clone();
        let served = bc_gateway::metrics::serve(listener, metrics.clone(), async move {
            let _ = until.wait_for(|stop| *stop).await;
        });
        tasks.push(tokio::spawn(async move {
            if let Err(e) = served.await {
                tracing::error!(error = %e, "serving the metrics failed");
            }
        }));
        tasks.push(tokio::spawn(bc_gateway::metrics::refresh(metrics, store, stopped.clone())));
    }
    shutdown_signal().await;
    let _ = stop.send(true);
    for task in tasks {
        let _ = task.await;
    }
    Ok(())
}

/// Key ids a refusal names at most.
const KEY_IDS_SHOWN_MAX: usize = 4;

/// Refuses to sign with a key the log does not know: when the database already knows signing
/// keys and the data directory holds none of them (a moved, lost or foreign `log.key`; with no
/// `log.key` at all, starting would create a new one), the log would go on under a key that
/// `audit verify` calls tampering. Also refuses while a key rotation is half done (`log.key.next`
/// present), saying how to finish it. A new database (no keys yet) takes the directory's key,
/// or a new one.
async fn check_log_key(store: &dyn EventStore, data_dir: &Path) -> Result<(), CliError> {
    let key_path = data_dir.join(LOG_KEY_FILE);
    let next_path = data_dir.join(format!("{LOG_KEY_FILE}.next"));
    if next_path.exists() {
        return Err(interrupted_rotation(store, data_dir, &key_path, &next_path).await);
    }
    let known: Vec<String> = store.signing_keys().await?.into_iter().map(|(key_id, _)| key_id).collect();
    if known.is_empty() {
        return Ok(());
    }
    let mut shown = known.iter().take(KEY_IDS_SHOWN_MAX).cloned().collect::<Vec<_>>().join(", ");
    if known.len() > KEY_IDS_SHOWN_MAX {
        shown.push_str(", …");
    }
    let dir = data_dir.display();
    if !key_path.exists() {
        return Err(CliError::new(
            "PKI_NOT_FOUND",
            format!("no log key at {}, but this database's log is signed by {shown}", key_path.display()),
        )
        .hint(format!(
            "restore that log.key into {dir} (or pass the --data-dir that holds it; `better-compute pki show --data-dir DIR` \
             names a directory's key id): a new key would make `audit verify` report the log as tampered"
        )));
    }
    let key = LogKey::load(&key_path)?;
    if !known.iter().any(|k| k == key.key_id()) {
        return Err(CliError::new(
            "PKI_MISMATCH",
            format!(
                "the log key in {} ({}) is not one this database's log is signed by ({shown})",
                key_path.display(),
                key.key_id()
            ),
        )
        .hint(format!(
            "{dir} belongs to another database: pass the --data-dir that holds this database's log.key \
             (`better-compute pki show --data-dir DIR` names a directory's key id)"
        )));
    }
    Ok(())
}

/// Sets the data key secrets are sealed under (`data.key` beside the log key; `create`: made at
/// first start) on `store`, and seals every secret not yet sealed under it (written before
/// sealing existed, or under the previous key of a rotation cut short). Refuses, before making
/// a key, a database whose secrets are sealed under a key this directory does not hold.
async fn seal_secrets(store: &dyn EventStore, path: &Path, create: bool) -> Result<(), CliError> {
    if !path.exists() {
        let first = store.secrets_page_raw(None, bc_core::store::RESEAL_ROWS_PER_READ).await?;
        if let Some(key_id) = first.iter().find_map(|(_, _, stored)| bc_core::sealing::sealed_key_id(stored)) {
            return Err(CliError::new(
                "DATA_KEY_NOT_FOUND",
                format!("no data key at {}, but this database's secrets are sealed under {key_id}", path.display()),
            )
            .hint("restore that data key (data.key beside the log key, or the file --data-key-file names)"));
        }
        if !create {
            return Ok(());
        }
    }
    let (keys, created) = bc_core::sealing::load_data_key_file(path, create)?;
    if created {
        tracing::info!(key_id = keys.current.id(), path = %path.display(), "created the data key");
    }
    store.set_data_keys(keys);
    let resealed = store.secrets_reseal().await.map_err(|e| match e {
        bc_core::Error::Corrupt { what, .. } if what.contains("does not hold") => CliError::new("DATA_KEY_MISMATCH", what).hint(
            "this database's secrets were sealed under another data key: pass the --data-dir (or --data-key-file) that holds it",
        ),
        other => other.into(),
    })?;
    if resealed > 0 {
        tracing::info!(resealed, "sealed secrets under the data key");
    }
    Ok(())
}

/// `pki rotate-data-key`: a new data key (`data.key.next`), every secret re-sealed under it
/// (the old key still opens what is not yet), then the new key takes `data.key`'s place. Cut
/// short, the next start (or this command again) finishes it: both keys stay on disk until then.
pub async fn rotate_data_key(db: &Database, path: &Path) -> Result<Value, CliError> {
    let store = db.open().await?;
    store.check_schema().await?;
    let next = bc_core::sealing::data_key_next_path(path);
    if !path.exists() {
        return Err(CliError::new("DATA_KEY_NOT_FOUND", format!("no data key at {}", path.display())).hint(
            "run better-compute dev (or serve) once to create it, or pass the --data-dir (or --data-key-file) that holds it",
        ));
    }
    let previous = bc_core::sealing::DataKey::load(path)?.id().to_owned();
    if !next.exists() {
        bc_core::sealing::DataKey::create(&next)?;
    }
    let (keys, _) = bc_core::sealing::load_data_key_file(path, false)?;
    let key_id = keys.current.id().to_owned();
    store.set_data_keys(keys);
    let resealed = store.secrets_reseal().await?;
    std::fs::rename(&next, path).map_err(|e| CliError::new("INTERNAL", format!("replacing {}: {e}", path.display())))?;
    bc_core::keys::sync_dir_of(path)?;
    Ok(json!({ "keyId": key_id, "previousKeyId": previous, "resealed": resealed }))
}

/// The refusal for a half-done `pki rotate-log-key`, with how to finish it: it writes
/// `log.key.next`, registers the new key and appends `log_key.rotated`, then renames `log.key`
/// to `log.key.OLD_KEY_ID` and `log.key.next` to `log.key`.
async fn interrupted_rotation(store: &dyn EventStore, data_dir: &Path, key_path: &Path, next_path: &Path) -> CliError {
    let dir = data_dir.display();
    let error = CliError::new(
        "PKI_ROTATION_INTERRUPTED",
        format!("{} exists: a log key rotation (`better-compute pki rotate-log-key`) did not finish", next_path.display()),
    );
    let next = match LogKey::load(next_path) {
        Ok(next) => next,
        Err(_) => {
            return error.hint(format!(
                "{} is unreadable, so the rotation was never used: delete it and run `better-compute pki rotate-log-key \
                 --data-dir {dir}` again",
                next_path.display()
            ));
        }
    };
    match rotation_recorded(store, next.key_id()).await {
        Ok(true) => {
            let archive = match LogKey::load(key_path) {
                Ok(old) => format!("mv {} {}/{LOG_KEY_FILE}.{} && ", key_path.display(), dir, old.key_id()),
                Err(_) => String::new(),
            };
            error.hint(format!(
                "the log records the rotation to {}: finish it with `{archive}mv {} {}`, then start again",
                next.key_id(),
                next_path.display(),
                key_path.display()
            ))
        }
        Ok(false) => error.hint(format!(
            "the log does not record a rotation to {}: delete {} and run `better-compute pki rotate-log-key --data-dir \
             {dir}` again",
            next.key_id(),
            next_path.display()
        )),
        Err(e) => error.hint(format!("reading the log to see whether the rotation was recorded failed: {}", e.public_message())),
    }
}

/// Whether the root tenant's chain records a rotation to `key_id` (`log_key.rotated`).
async fn rotation_recorded(store: &dyn EventStore, key_id: &str) -> bc_core::Result<bool> {
    use bc_core::id::TenantId;
    let root = TenantId::ROOT;
    let stream = format!("log_key/{root}");
    let mut after = 0;
    loop {
        let page =
            bc_core::store::decode_rows(store.read_stream_rows(root, &stream, after, bc_core::store::READ_ROWS_MAX).await?)?;
        let Some(last) = page.last() else { return Ok(false) };
        after = last.envelope.version;
        let names_key =
            |event: &bc_core::event::StoredEvent| bc_core::canonical::to_json(&event.envelope.payload)["newKeyId"] == key_id;
        if page.iter().any(|e| e.envelope.event_type == bc_core::audit::LOG_KEY_ROTATED && names_key(e)) {
            return Ok(true);
        }
    }
}

/// How the agents' endpoint runs in `dev` and `serve`.
#[derive(Clone, Debug)]
pub struct AgentsOptions {
    pub listen: SocketAddr,
    /// The serving certificate chain and key given by flags; `None`: the one in the data
    /// directory (made at first start).
    pub tls_files: Option<(PathBuf, PathBuf)>,
    /// h2c instead of TLS (`dev` on loopback only; the caller checks).
    pub plaintext: bool,
    pub session: bc_gateway::agents::SessionConfig,
    /// The endpoint's connection, stream and join bounds (`--agents-*` flags).
    pub limits: bc_gateway::agents::AgentLimits,
    /// How long a node certificate is valid (`--node-cert-lifetime`).
    pub node_cert_lifetime_ms: u64,
    /// The endpoint as agents reach it (`--agents-url`), which the well-known document names;
    /// `None`: the bound address.
    pub public_url: Option<String>,
    /// Join tokens only sealed (`--agents-sealed-joins-only`).
    pub sealed_joins_only: bool,
    /// TPM joins' EK CA bundle and pool (`--tpm-ek-ca-bundle`, `--tpm-join-pool`).
    pub tpm_joins: Option<bc_gateway::agents::tpm_join::TpmJoins>,
}

impl AgentsOptions {
    /// Checks what flags cannot: h2c only on loopback and only in `dev`, TLS files not with
    /// h2c, a heartbeat well within the lease.
    pub fn new(
        listen: &str,
        tls_files: Option<(PathBuf, PathBuf)>,
        plaintext: bool,
        dev: bool,
        session: bc_gateway::agents::SessionConfig,
        limits: bc_gateway::agents::AgentLimits,
    ) -> Result<Self, CliError> {
        let listen: SocketAddr =
            listen.parse().map_err(|_| CliError::usage(format!("--agents-listen {listen:?} is not HOST:PORT")))?;
        if plaintext {
            if !dev {
                return Err(CliError::usage("--agents-insecure-h2c is for dev only: serve speaks TLS to agents"));
            }
            if !listen.ip().is_loopback() {
                return Err(CliError::usage(format!(
                    "--agents-insecure-h2c needs a loopback --agents-listen, not {listen}: plaintext never leaves the machine"
                ))
                .hint("use --agents-listen 127.0.0.1:PORT, or drop --agents-insecure-h2c to serve TLS"));
            }
            if tls_files.is_some() {
                return Err(CliError::usage("--agents-insecure-h2c takes no --agents-tls-cert or --agents-tls-key"));
            }
        }
        if session.heartbeat_ms.saturating_mul(2) >= session.lease_ms {
            return Err(CliError::usage(format!(
                "--node-heartbeat ({} ms) must be less than half --node-lease ({} ms), so one lost heartbeat does not make a node unreachable",
                session.heartbeat_ms, session.lease_ms
            )));
        }
        Ok(Self {
            listen,
            tls_files,
            plaintext,
            session,
            limits,
            node_cert_lifetime_ms: bc_gateway::node_ca::NODE_CERT_LIFETIME_MS_DEFAULT,
            public_url: None,
            sealed_joins_only: false,
            tpm_joins: None,
        })
    }
}

/// The deployment's join keys (made and stored, sealed under the data key, at the first start),
/// their public halves and pins written to [`bc_gateway::join_keys::JOIN_KEYS_FILE`] in the data
/// directory (public; `pki show` prints them).
async fn join_keys(log: &Log, data_dir: &Path) -> Result<Arc<bc_gateway::join_keys::JoinKeys>, CliError> {
    let (keys, created) = bc_gateway::join_keys::JoinKeys::load_or_create(&*log.store, log.clock.now_ms()).await?;
    if created {
        tracing::info!(signing_pin = %keys.signing_pin(), encryption_pin = %keys.encryption().pin(), "created the join keys");
    }
    let path = data_dir.join(bc_gateway::join_keys::JOIN_KEYS_FILE);
    let text = serde_json::to_string_pretty(&keys.public_json()).map_err(|e| CliError::new("INTERNAL", e.to_string()))?;
    std::fs::write(&path, format!("{text}\n"))
        .map_err(|e| CliError::new("INTERNAL", format!("cannot write {}: {e}", path.display())))?;
    Ok(Arc::new(keys))
}

/// The deployment's node CA (made and stored, sealed under the data key, at the first start),
/// its revoked set loaded from the nodes' documents, and its certificate written to
/// [`bc_gateway::node_ca::NODE_CA_FILE`] in the data directory (public; `pki show` names it).
async fn node_ca(log: &Log, data_dir: &Path, lifetime_ms: u64) -> Result<Arc<bc_gateway::node_ca::NodeCa>, CliError> {
    let (ca, created) = bc_gateway::node_ca::NodeCa::load_or_create(&*log.store, log.clock.now_ms(), lifetime_ms).await?;
    if created {
        tracing::info!(pin = %ca.pin(), "created the node CA");
    }
    let revoked = ca.load_revoked(&*log.store).await?;
    if revoked > 0 {
        tracing::info!(revoked, "loaded the revoked nodes");
    }
    write_node_ca_file(&data_dir.join(bc_gateway::node_ca::NODE_CA_FILE), &ca.trusted_pem(log.clock.now_ms()))?;
    Ok(Arc::new(ca))
}

/// Writes the node CA's trusted certificates (public) whole: a new file renamed over the old,
/// so a reader never sees half of it.
fn write_node_ca_file(path: &Path, pem: &str) -> Result<(), CliError> {
    let mut partial = path.as_os_str().to_owned();
    partial.push(".new");
    std::fs::write(&partial, pem)
        .and_then(|()| std::fs::rename(&partial, path))
        .map_err(|e| CliError::new("INTERNAL", format!("cannot write {}: {e}", path.display())))
}

/// Every `NODE_CA_REFRESH_MS`, reads the node CA's row again (a `pki renew-ca` made by another
/// process becomes current here) and rewrites `node-ca.crt` when what verifies changed: a
/// renewal, or a replaced CA's overlap ending. Until `stopped`.
fn keep_node_ca_fresh(
    log: Arc<Log>,
    ca: Arc<bc_gateway::node_ca::NodeCa>,
    path: PathBuf,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) {
    tokio::spawn(async move {
        // A roll still in its overlap is recorded (once: `record_renewal` is idempotent), in case
        // the `pki renew-ca` that made it died before it appended the event.
        let mut unrecorded = !record_node_ca_renewal(&log, &ca, true).await;
        let mut written = ca.trusted_pem(log.clock.now_ms());
        let mut tick = tokio::time::interval(std::time::Duration::from_millis(bc_gateway::node_ca::NODE_CA_REFRESH_MS));
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stopped.changed() => return,
            }
            match ca.refresh(&*log.store).await {
                Ok(true) => unrecorded = true,
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "could not read the node CA again"),
            }
            // Until the roll is in the log: a failed append is tried again at the next tick (the
            // row no longer changes, so a refresh alone would never try it again).
            if unrecorded {
                unrecorded = !record_node_ca_renewal(&log, &ca, false).await;
            }
            let pem = ca.trusted_pem(log.clock.now_ms());
            if pem != written {
                match write_node_ca_file(&path, &pem) {
                    Ok(()) => written = pem,
                    Err(e) => tracing::warn!(error = %e.message, "could not write the node CA's certificates"),
                }
            }
        }
    });
}

/// Appends `node_ca.renewed` for the roll that made `ca`'s current CA current, if there was one
/// (`in_overlap_only`: and its overlap has not ended); `false` only when the append failed.
async fn record_node_ca_renewal(log: &Log, ca: &bc_gateway::node_ca::NodeCa, in_overlap_only: bool) -> bool {
    let Some(renewed) = ca.renewal() else { return true };
    if in_overlap_only && renewed.overlap_ends_at_ms <= log.clock.now_ms() {
        return true;
    }
    match bc_gateway::node_ca::NodeCa::record_renewal(log, &renewed).await {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(error = %e, "could not record the node CA's renewal; the next tick tries again");
            false
        }
    }
}

/// `pki renew-ca`: a new node CA, the replaced one trusted beside it for `overlap_ms` (in a
/// debug build, `BC_TEST_ONLY_NODE_CA_OVERLAP_MS` instead); `node-ca.crt` rewritten with both.
pub async fn renew_node_ca(db: &Database, data_dir: &Path, data_key_path: &Path, overlap_ms: u64) -> Result<Value, CliError> {
    let store = db.open().await?;
    store.check_schema().await?;
    if !data_key_path.exists() {
        return Err(CliError::new("DATA_KEY_NOT_FOUND", format!("no data key at {}", data_key_path.display()))
            .hint("the new CA is sealed under it: pass the --data-dir (or --data-key-file) that dev or serve uses"));
    }
    seal_secrets(&*store, data_key_path, false).await?;
    let now_ms = SystemClock.now_ms();
    let overlap_ms = bc_gateway::node_ca::overlap_ms(overlap_ms);
    let key_path = data_dir.join(LOG_KEY_FILE);
    if !key_path.exists() {
        return Err(CliError::new("PKI_NOT_FOUND", format!("no log key at {}", key_path.display()))
            .hint("the renewal is recorded in the log: pass the --data-dir that dev or serve uses"));
    }
    check_log_key(&*store, data_dir).await?;
    let key = Arc::new(LogKey::load(&key_path)?);
    let log = Log::open(store.clone(), Arc::new(Projections), key, Arc::new(SystemClock)).await?;
    let renewed = bc_gateway::node_ca::NodeCa::renew(&*store, now_ms, overlap_ms).await?;
    let path = data_dir.join(bc_gateway::node_ca::NODE_CA_FILE);
    write_node_ca_file(&path, &renewed.trusted_pem)?;
    let event = bc_projections::events::NodeCaRenewed {
        pin: renewed.pin.clone(),
        previous_pin: renewed.previous_pin.clone(),
        overlap_ends_at_ms: renewed.overlap_ends_at_ms,
    };
    // The servers record it too when they read the roll: a failure here loses nothing.
    let recorded = bc_gateway::node_ca::NodeCa::record_renewal(&log, &event).await;
    if let Err(e) = &recorded {
        tracing::warn!(error = %e, "could not record the renewal now; each server records it when it reads the roll");
    }
    Ok(json!({
        "pin": renewed.pin,
        "previousPin": renewed.previous_pin,
        "overlapEndsAtMs": renewed.overlap_ends_at_ms,
        "overlapEnds": bc_core::clock::rfc3339_ms(renewed.overlap_ends_at_ms),
        "certificate": path.display().to_string(),
        "recorded": recorded.is_ok(),
        "next": format!(
            "node certificates are issued by the new CA within {} s on every server; nodes renew onto it before the overlap ends",
            bc_gateway::node_ca::NODE_CA_REFRESH_MS / 1000
        ),
    }))
}

/// The agents' endpoint's transport, and the pin agents check (none for h2c). Over TLS, each
/// peer is asked for a node certificate of `node_ca`.
fn agents_transport(
    options: &AgentsOptions,
    data_dir: &Path,
    node_ca: &Arc<bc_gateway::node_ca::NodeCa>,
) -> Result<(bc_gateway::agents::Transport, Option<String>), CliError> {
    use bc_gateway::agents::tls::ServingIdentity;
    if options.plaintext {
        return Ok((bc_gateway::agents::Transport::Plaintext, None));
    }
    let identity = match &options.tls_files {
        Some((cert, key)) => ServingIdentity::load(cert, key)?,
        None => {
            let (identity, created) = ServingIdentity::load_or_create(data_dir, &[])?;
            if created {
                tracing::info!(pin = %identity.pin, dir = %data_dir.display(), "made the agents' serving certificate");
            }
            identity
        }
    };
    let config = identity.server_config_for_nodes(Some(node_ca.client_verifier()?))?;
    Ok((bc_gateway::agents::Transport::Tls(config), Some(identity.pin.clone())))
}

/// Open files a server needs beside its `--connections-max` connections: the database's, the
/// webhooks' and the agents' own (a rough allowance, for the warning below).
const FILES_BESIDE_CONNECTIONS: u64 = 256;

/// Raises the soft open-file limit to the hard one, as Go's runtime does at start: the default
/// `--connections-max` (so that every watcher can hold a connection) is over the usual soft limit
/// of 1,024. Warns when even the hard limit is short of what `connections_max` needs.
fn raise_open_file_limit(connections_max: usize) {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    if let (Some(current), Some(maximum)) = (limit.current, limit.maximum)
        && current < maximum
        && let Err(e) = setrlimit(Resource::Nofile, Rlimit { current: Some(maximum), maximum: Some(maximum) })
    {
        tracing::debug!(error = %e, current, maximum, "could not raise the open-file limit");
    }
    let wanted = connections_max as u64 + FILES_BESIDE_CONNECTIONS;
    if let Some(now) = getrlimit(Resource::Nofile).current
        && now < wanted
    {
        tracing::warn!(
            limit = now,
            connections_max,
            "the open-file limit is below what --connections-max needs; hint: raise it (ulimit -n {wanted}) or lower --connections-max"
        );
    }
}

/// On PostgreSQL, a warning at the start when the server acknowledges commits that no standby
/// has yet (`doctor`'s `synchronous-commit` and `replication` checks, docs/high-availability.md):
/// a failover would lose them. Nothing is refused: one server without standbys is a deployment
/// this supports, and says so in `doctor`.
async fn warn_unreplicated(db: &Database, store: &dyn EventStore) {
    let Database::Postgres(_) = db else { return };
    let Ok(facts) = store.server_facts().await else { return };
    let pool = bc_core::store::postgres::POOL_CONNECTIONS_MAX as u64;
    for check in crate::doctor::postgres_settings_check(&facts.settings, pool) {
        if matches!(check.name, "synchronous-commit" | "replication") && check.status == bc_agent::doctor::Status::Warn {
            tracing::warn!(check = check.name, fix = check.fix.as_deref().unwrap_or(""), "{}", check.message);
        }
    }
}

/// What the deployment demands of work that changes nodes: the keys agent releases must be
/// signed by (`--release-key`), and whether fleet-wide destructive calls need the approvers'
/// quorum (`--approvers`, docs/batches.md).
pub struct Safeguards {
    pub release_keys: Vec<bc_core::release::ReleasePublicKey>,
    pub batch_quorum: bool,
}

/// `dev` and `serve`: open, (for dev) migrate, bootstrap, listen, serve until Ctrl-C/SIGTERM.
/// `roles` says which parts run here (`crate::roles`); `sim_nodes` starts that many simulated
/// agents in this process (`dev --sim N`, `crate::sim_agents`).
#[allow(clippy::too_many_arguments)]
pub async fn run_server(
    db: Database,
    data_dir: &Path,
    data_key_path: &Path,
    (listen, metrics_listen): (&str, Option<&str>),
    migrate_first: bool,
    checkpoint_interval_s: u64,
    deployment: &str,
    witnesses: &[String],
    consumers: &ConsumerOptions,
    (roles, sim_nodes): (&crate::roles::Roles, Option<u32>),
    limits: bc_gateway::ServeLimits,
    agents: &AgentsOptions,
    safeguards: Safeguards,
) -> Result<(), CliError> {
    let Safeguards { release_keys, batch_quorum } = safeguards;
    if sim_nodes.is_some() && !roles.agents {
        return Err(CliError::usage("--sim needs the agents role: the simulated agents connect to this process"));
    }
    let addr: SocketAddr = listen.parse().map_err(|_| CliError::usage(format!("--listen {listen:?} is not HOST:PORT")))?;
    raise_open_file_limit(limits.connections_max);
    create_private_dir(data_dir)?;
    let (store, key, log) = open_store_and_log(&db, data_dir, data_key_path, migrate_first).await?;
    warn_unreplicated(&db, &*store).await;
    let token_path = data_dir.join(ADMIN_TOKEN_FILE);
    let created_token = bootstrap_admin(&log, &token_path).await?;
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        CliError::new("UNAVAILABLE", format!("cannot listen on {addr}: {e}")).hint("pick another --listen address")
    })?;
    let bound = listener.local_addr().map_err(|e| CliError::new("INTERNAL", e.to_string()))?;
    let node_ca = node_ca(&log, data_dir, agents.node_cert_lifetime_ms).await?;
    let agents_endpoint = match roles.agents {
        true => Some(bind_agents(agents, data_dir, &node_ca).await?),
        false => None,
    };
    let metrics_listener = bind_metrics(metrics_listen).await?;
    // stdout is for people and for the test harness, which reads the URL from the first line.
    println!("better-compute listening on http://{bound}");
    println!("  database:  {}", db.describe());
    println!("  log key:   {} {}", key.key_id(), key.pin());
    if created_token {
        println!(
            "  admin token: written to {} (mode 0600); export BETTER_COMPUTE_TOKEN=$(cat {})",
            token_path.display(),
            token_path.display()
        );
    } else {
        println!("  admin token: {} (from the first start)", token_path.display());
    }
    if let Some((_, addr)) = &metrics_listener {
        println!("  metrics:   http://{addr}/metrics");
    }
    let ssh_user_ca = ssh_user_ca(&log, data_dir).await?;
    let join_keys = join_keys(&log, data_dir).await?;
    // The well-known document names this process's agents' endpoint (none without the role).
    let well_known = match &agents_endpoint {
        Some(endpoint) => {
            let url = agents.public_url.clone().unwrap_or_else(|| endpoint.url());
            Some(join_keys.document(&url, endpoint.pin.as_deref(), &key.pin())?)
        }
        None => None,
    };
    let mut state = AppState::new(log.clone())
        .with_join_keys(join_keys.clone(), well_known)
        .with_sealed_joins_only(agents.sealed_joins_only)
        .with_tpm_joins(agents.tpm_joins.clone())
        .with_webhook_policy(consumers.policy)
        .with_bmc_networks(consumers.bmc_networks.clone())
        .with_release_keys(release_keys.clone())
        .with_ssh_user_ca(ssh_user_ca)
        .with_node_ca(node_ca.clone());
    state.metrics_on_api = metrics_listener.is_none();
    state.api_served = roles.api;
    state.batch_quorum = batch_quorum;
    // Before the reconcilers start, so their first passes are counted.
    bc_reconcilers::driver::observe(Arc::new(PassMetrics(state.metrics.clone())));
    let metrics_served = metrics_listener
        .map(|(listener, _)| tokio::spawn(bc_gateway::metrics::serve(listener, state.metrics.clone(), std::future::pending())));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let duties = ServerDuties { checkpoint_interval_s, deployment, witnesses };
    keep_node_ca_fresh(log.clone(), node_ca.clone(), data_dir.join(bc_gateway::node_ca::NODE_CA_FILE), stopped.clone());
    let tasks = start_server_reconcilers(store, &log, data_dir, duties, &roles.chosen(), consumers, &stopped)?;
    if *roles != crate::roles::Roles::all() {
        println!("  roles:     {} (serve --roles)", roles.describe());
    }
    // The test harness reads this line too: `https://ADDR (pin sha256/…)`, `h2c://ADDR (…)`, or
    // `none (…)`.
    match &agents_endpoint {
        Some(AgentsEndpoint { pin: Some(pin), bound, .. }) => println!("  agents:    https://{bound} (pin {pin})"),
        Some(AgentsEndpoint { pin: None, bound, .. }) => println!("  agents:    h2c://{bound} (plaintext, loopback only)"),
        None => println!("  agents:    none (not this process's role)"),
    }
    if batch_quorum {
        println!("  approvers: quorum on (--approvers): wide destructive calls need a batch");
    }
    if !release_keys.is_empty() {
        println!("  releases:  trusted keys {}", release_keys.iter().map(|k| k.key_id()).collect::<Vec<_>>().join(", "));
    }
    state.watchers = bc_gateway::watch::WatcherSlots::new(limits.watchers);
    state.tunnels = bc_gateway::tunnels::Tunnels::new(limits.tunnels);
    state.rate_limiter = Arc::new(bc_gateway::rate_limit::RateLimiter::new(limits.rate));
    state.limits = limits;
    let state = Arc::new(state);
    let agents_served = agents_endpoint.map(|endpoint| {
        let service = bc_gateway::agents::AgentService::with_limits(state.clone(), agents.session, agents.limits);
        (endpoint, service)
    });
    let mut sim_task = None;
    if let (Some(nodes), Some((endpoint, _))) = (sim_nodes, &agents_served) {
        let plan = crate::sim_agents::Plan {
            nodes,
            api_url: format!("http://{bound}"),
            token_path: token_path.clone(),
            agents: endpoint.url(),
            agents_pin: endpoint.pin.clone(),
            log_key_pin: key.pin(),
            data_dir: data_dir.join(crate::sim_agents::SIM_DIR),
        };
        sim_task = Some(tokio::spawn(crate::sim_agents::run(plan, stopped.clone())));
    }
    let (served, agents_served) = serve_until_signal(listener, state, agents_served).await;
    let _ = stop.send(true);
    for task in tasks {
        let _ = task.await;
    }
    if let Some(sim) = sim_task {
        let _ = sim.await;
    }
    if let Some(metrics) = metrics_served {
        metrics.abort();
    }
    served.map_err(|e| CliError::new("INTERNAL", format!("server: {e}")))?;
    agents_served.map_err(|e| CliError::new("INTERNAL", format!("agents' endpoint: {e}")))?;
    tracing::info!("stopped");
    Ok(())
}

/// The agents' endpoint of a process with the `agents` role, bound.
struct AgentsEndpoint {
    listener: tokio::net::TcpListener,
    bound: SocketAddr,
    transport: bc_gateway::agents::Transport,
    /// The serving certificate's pin agents check (none for h2c).
    pin: Option<String>,
}

impl AgentsEndpoint {
    /// The endpoint as `bcd`'s `gateway` names it.
    fn url(&self) -> String {
        match self.pin {
            Some(_) => format!("https://{}", self.bound),
            None => format!("http://{}", self.bound),
        }
    }
}

/// Binds `--agents-listen` with its transport (the serving certificate made at the first start).
async fn bind_agents(
    agents: &AgentsOptions,
    data_dir: &Path,
    node_ca: &Arc<bc_gateway::node_ca::NodeCa>,
) -> Result<AgentsEndpoint, CliError> {
    let (transport, pin) = agents_transport(agents, data_dir, node_ca)?;
    let listener = tokio::net::TcpListener::bind(agents.listen).await.map_err(|e| {
        CliError::new("UNAVAILABLE", format!("cannot listen on {} for agents: {e}", agents.listen))
            .hint("pick another --agents-listen address")
    })?;
    let bound = listener.local_addr().map_err(|e| CliError::new("INTERNAL", e.to_string()))?;
    Ok(AgentsEndpoint { listener, bound, transport, pin })
}

/// The reconciler driver's passes, counted in the gateway's metrics (`/metrics`).
struct PassMetrics(Arc<bc_gateway::metrics::Metrics>);

impl bc_reconcilers::driver::PassObserver for PassMetrics {
    fn pass(&self, reconciler: &'static str, ok: bool, duration: std::time::Duration) {
        self.0.reconciler_pass(reconciler, ok, duration);
    }

    fn outbox_completed(&self, consumer: &'static str, outcome: &'static str, latency: std::time::Duration) {
        self.0.outbox_completed(consumer, outcome, latency);
    }

    fn sandboxes_seen(&self, live: u64, warm: u64) {
        self.0.sandboxes_seen(live, warm);
    }
}

/// `--metrics-listen`'s listener and its bound address, when given.
async fn bind_metrics(listen: Option<&str>) -> Result<Option<(tokio::net::TcpListener, SocketAddr)>, CliError> {
    let Some(listen) = listen else { return Ok(None) };
    let addr: SocketAddr =
        listen.parse().map_err(|_| CliError::usage(format!("--metrics-listen {listen:?} is not HOST:PORT")))?;
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        CliError::new("UNAVAILABLE", format!("cannot listen on {addr} for metrics: {e}"))
            .hint("pick another --metrics-listen address")
    })?;
    let bound = listener.local_addr().map_err(|e| CliError::new("INTERNAL", e.to_string()))?;
    Ok(Some((listener, bound)))
}

/// The store (migrated first when asked, its schema and log key checked, its secrets sealed
/// under the data key) and the log over it, under the data directory's log key, created on the
/// first start.
async fn open_store_and_log(
    db: &Database,
    data_dir: &Path,
    data_key_path: &Path,
    migrate_first: bool,
) -> Result<(Arc<dyn EventStore>, Arc<LogKey>, Arc<Log>), CliError> {
    let store = db.open().await?;
    if migrate_first {
        let applied = store.migrate_at(SystemClock.now_ms()).await?;
        if !applied.is_empty() {
            tracing::info!(?applied, "applied migrations");
        }
    }
    store.check_schema().await?;
    check_log_key(&*store, data_dir).await?;
    seal_secrets(&*store, data_key_path, true).await?;
    let key_path = data_dir.join(LOG_KEY_FILE);
    let (key, created) = LogKey::load_or_create(&key_path)?;
    if created {
        tracing::info!(key_id = key.key_id(), path = %key_path.display(), "created the log key");
    }
    let key = Arc::new(key);
    let log = Arc::new(Log::open(store.clone(), Arc::new(Projections), key.clone(), Arc::new(SystemClock)).await?);
    Ok((store, key, log))
}

/// The administrator key of a database that has none, its token written to `token_path` (mode
/// 0600): true when this start made it. A token file left by another database is refused.
async fn bootstrap_admin(log: &Log, token_path: &Path) -> Result<bool, CliError> {
    let created = bc_gateway::bootstrap_root(
        log,
        |token| {
            write_secret_file(token_path, format!("{token}\n").as_bytes()).map_err(|e| match e {
                bc_core::Error::AlreadyExists { .. } => bc_core::Error::InvalidArgument {
                    message: format!("{} exists but this database has no administrator key", token_path.display()),
                    hint: Some("it belongs to another database: move it away and start again".into()),
                },
                other => other,
            })
        },
        || {
            let _ = std::fs::remove_file(token_path);
        },
    )
    .await?;
    Ok(created)
}

/// The server's own duties' settings (`--checkpoint-interval`, `--deployment`, `--witness`).
struct ServerDuties<'a> {
    checkpoint_interval_s: u64,
    deployment: &'a str,
    witnesses: &'a [String],
}

/// Starts `chosen` (the roles' reconcilers: `crate::roles::Roles::chosen`) until `stopped`.
/// Prints the witnesses and the reconcilers started.
fn start_server_reconcilers(
    store: Arc<dyn EventStore>,
    log: &Arc<Log>,
    data_dir: &Path,
    duties: ServerDuties<'_>,
    chosen: &[&'static Registration],
    options: &ConsumerOptions,
    stopped: &tokio::sync::watch::Receiver<bool>,
) -> Result<Vec<tokio::task::JoinHandle<()>>, CliError> {
    let ServerDuties { checkpoint_interval_s, deployment, witnesses } = duties;
    let sealing = match checkpoint_interval_s {
        0 => None,
        interval_s => Some(registry::Sealing {
            interval_s,
            deployment: deployment.to_owned(),
            trust: crate::audit::local_trust(data_dir, deployment)?,
        }),
    };
    let witnesses = parse_witnesses(witnesses)?;
    if !witnesses.is_empty() {
        println!("  witnesses: {}", witnesses.iter().map(|w| w.label.as_str()).collect::<Vec<_>>().join(", "));
    }
    let inputs = reconciler_inputs(store, Some(log.clone()), Some(log.subscribe()), options, sealing, witnesses);
    let mut tasks = Vec::new();
    let started = start_reconcilers(chosen, &inputs, stopped, &mut tasks)?;
    if started.iter().any(|name| registry::find(name).is_some_and(|r| !r.duty)) {
        println!("  reconcilers: {} (in process)", started.join(", "));
    }
    Ok(tasks)
}

/// Serves HTTP on `listener` (the API, or only the probes and the scrape without the `api`
/// role) and the agents' endpoint when this process has it, until Ctrl-C/SIGTERM, which stops
/// both; their outcomes.
async fn serve_until_signal(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    agents: Option<(AgentsEndpoint, bc_gateway::agents::AgentService)>,
) -> (std::io::Result<()>, std::io::Result<()>) {
    // One signal stops both listeners.
    let (signal, signalled) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        let _ = signal.send(true);
    });
    let on_signal = |mut signalled: tokio::sync::watch::Receiver<bool>| async move {
        let _ = signalled.wait_for(|stop| *stop).await;
    };
    let agents_served = async {
        match agents {
            Some((endpoint, service)) => {
                bc_gateway::agents::serve(endpoint.listener, endpoint.transport, service, on_signal(signalled.clone())).await
            }
            None => Ok(()),
        }
    };
    let http_served = bc_gateway::serve(listener, state, on_signal(signalled.clone()));
    tokio::join!(http_served, agents_served)
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("installing SIGTERM handler");
    tokio::select! {
        _ = ctrl_c => {}
        _ = term.recv() => {}
    }
}

/// What `reconcilers status` says of a registered reconciler no process has recorded a pass of
/// (within `PASS_FORGET_MS`).
pub const NEVER_RUN: &str = "never run";

/// `reconcilers status`: every reconciler's last pass in every process, from the database
/// (`items`), and every registered reconciler with no pass recorded (`neverRun`, in the
/// registry's order, each `{name, state: "never run"}`, with no last pass): together, the whole
/// registry.
pub async fn reconcilers_status(db: &Database) -> Result<Value, CliError> {
    let store = db.open().await?;
    store.check_schema().await?;
    let passes = store.passes().await?;
    let never_run: Vec<Value> = REGISTRY
        .iter()
        .filter(|r| !passes.iter().any(|p| p.name == r.name))
        .map(|r| json!({ "name": r.name, "state": NEVER_RUN }))
        .collect();
    Ok(json!({ "items": passes, "neverRun": never_run }))
}
