//! `better-compute doctor [--strict] [--json]`: what is wrong with a deployment, each check `ok`,
//! `warn` or `fail` with a fix a person can act on, in the format of `bcd doctor`
//! (`bc_agent::doctor`, whose report types this reuses). It reads and never writes: the database
//! (reachable, its schema, its clock and settings, the reconcilers' last passes, the keys it
//! registered and the secrets' key ids), the data directory's key files and the agents' serving
//! certificate, and the free disk beside the embedded database; with `--witness` (or the
//! configuration file's `witness`), each witness: reachable, and cosigning ([`witness_checks`]).
//!
//! The verdicts are pure functions of what was read (`schema_check`, `clock_check`,
//! `postgres_settings_check`, `key_file_check`, `certificate_check`, `disk_check`,
//! `reconcilers_check`, `witness_check`), each tested with its own inputs; [`run`] and
//! [`witness_checks`] do the reading.

use std::path::Path;

use bc_agent::doctor::{Check, Status};
use bc_core::clock::{Clock, SystemClock};
use bc_core::store::EventStore;
use bc_core::store::status::PassRecord;

use crate::client::CliError;
use crate::server::{Database, LOG_KEY_FILE};

/// Skew between this host's clock and the database's past this is a warning: leases, deadlines
/// and usage windows are stamped by the processes, compared across them.
pub const CLOCK_SKEW_WARN_MS: u64 = 2_000;
/// Past this it fails: a lease or a ticket would look expired, or far from it, on arrival.
pub const CLOCK_SKEW_FAIL_MS: u64 = 60_000;
/// A reconciler whose newest pass (in any process) is older than this is not running.
pub const RECONCILER_STALE_MS: u64 = 5 * 60 * 1000;
/// An agents' certificate expiring within this warns.
pub const CERTIFICATE_EXPIRY_WARN_MS: u64 = 30 * 24 * 3600 * 1000;
/// Free disk beside the embedded database below this share (in thousandths) or size warns...
pub const DISK_FREE_WARN: (u64, u64) = (100, 2 << 30);
/// ... and below these fails: SQLite cannot commit on a full disk.
pub const DISK_FREE_FAIL: (u64, u64) = (10, 256 << 20);
/// Processes one PostgreSQL should have room for (two API, the agents' endpoint, reconcilers),
/// each with a full pool.
pub const POSTGRES_PROCESSES_EXPECTED: u64 = 4;
/// Sealed secrets read to check the data key opens them (their key ids).
const SECRETS_SAMPLED: u32 = 1000;
/// How long a witness has to accept a TCP connection before it is called unreachable.
pub const WITNESS_CONNECT_TIMEOUT_MS: u64 = 3_000;

/// One witness: `reached` whether its URL's host and port took a connection (or why not);
/// `cosigned` the root tenant's newest checkpoint's size and whether it carries this witness's
/// cosignature (none: no checkpoint sealed yet).
pub fn witness_check(label: &str, url: &str, reached: Result<(), String>, cosigned: Option<(u64, bool)>) -> Check {
    let name = "witness";
    match (reached, cosigned) {
        (Err(why), _) => Check::fail(
            name,
            format!("{label} at {url}: {why}"),
            "start the witness, or correct its URL in --witness (the witnesses reconciler retries it with back-off meanwhile)",
        ),
        (Ok(()), None) => Check::ok(name, format!("{label} at {url} answers; no checkpoint is sealed yet")),
        (Ok(()), Some((size, true))) => {
            Check::ok(name, format!("{label} at {url} answers and cosigned the newest checkpoint (size {size})"))
        }
        (Ok(()), Some((size, false))) => Check::warn(
            name,
            format!("{label} at {url} answers but has not cosigned the newest checkpoint (size {size})"),
            "the witnesses reconciler sends each new checkpoint within seconds: check it runs (`reconcilers status`) with              this --witness, and its log for the witness's refusals",
        ),
    }
}

/// Each witness (`NAME=URL+VKEY`): a TCP connection to its URL's host and port (doctor sends it
/// nothing: a checkpoint sent would be a witness's state changed), and its cosignature on the
/// root tenant's newest checkpoint, as the log holds it.
pub async fn witness_checks(db: &Database, witnesses: &[String]) -> Vec<Check> {
    let mut checks = Vec::new();
    let newest = match witnesses.is_empty() {
        true => None,
        false => match db.open().await {
            Ok(store) => bc_core::audit::newest_checkpoint(&*store, bc_core::id::TenantId::ROOT).await.ok().flatten(),
            Err(_) => None,
        },
    };
    for text in witnesses {
        let witness = match bc_reconcilers::witnesses::Witness::parse(text) {
            Ok(witness) => witness,
            Err(e) => {
                checks.push(Check::fail("witness", e, "give --witness as NAME=URL+VKEY, as dev and serve take it"));
                continue;
            }
        };
        let reached = reach(&witness.url).await;
        let cosigned = newest.as_ref().map(|cp| (cp.size, witness.key.cosigned(&cp.cosigned_note())));
        checks.push(witness_check(&witness.label, &witness.url, reached, cosigned));
    }
    checks
}

/// A TCP connection to `url`'s host and port within [`WITNESS_CONNECT_TIMEOUT_MS`].
async fn reach(url: &str) -> Result<(), String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("its URL does not parse: {e}"))?;
    let host = parsed.host_str().ok_or("its URL has no host")?.to_owned();
    let port = parsed.port_or_known_default().ok_or("its URL has no port")?;
    let timeout = std::time::Duration::from_millis(WITNESS_CONNECT_TIMEOUT_MS);
    match tokio::time::timeout(timeout, tokio::net::TcpStream::connect((host.as_str(), port))).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(format!("cannot connect: {e}")),
        Err(_) => Err(format!("no connection within {} s", WITNESS_CONNECT_TIMEOUT_MS / 1000)),
    }
}

/// The database's schema: `applied` the newest migration applied, `latest` this binary's.
pub fn schema_check(applied: Option<u64>, latest: u64) -> Check {
    match applied {
        None => Check::fail("schema", "no migration is applied", "run `better-compute migrate` (dev does it at start)"),
        Some(v) if v < latest => Check::fail(
            "schema",
            format!("migrations {} to {latest} are not applied (the database is at {v})", v + 1),
            "run `better-compute migrate` before starting this version",
        ),
        Some(v) if v > latest => Check::fail(
            "schema",
            format!("the database is at migration {v}, newer than this binary's {latest}"),
            "run the newer better-compute that migrated it",
        ),
        Some(v) => Check::ok("schema", format!("current (migration {v})")),
    }
}

/// The database's clock (`db_ms`, read between `sent_ms` and `received_ms` on this host's).
pub fn clock_check(sent_ms: u64, received_ms: u64, db_ms: u64) -> Check {
    let skew: i64 = if db_ms < sent_ms {
        -((sent_ms - db_ms) as i64)
    } else if db_ms > received_ms {
        (db_ms - received_ms) as i64
    } else {
        0
    };
    let magnitude = skew.unsigned_abs();
    let side = if skew > 0 { "ahead of" } else { "behind" };
    let fix = "synchronise the clocks (chrony or systemd-timesyncd) of this host and the database's";
    let message = format!("the database's clock is {magnitude} ms {side} this host's");
    if magnitude > CLOCK_SKEW_FAIL_MS {
        Check::fail("clock", message, fix)
    } else if magnitude > CLOCK_SKEW_WARN_MS {
        Check::warn("clock", message, fix)
    } else {
        Check::ok("clock", format!("within {CLOCK_SKEW_WARN_MS} ms of the database's"))
    }
}

/// PostgreSQL's settings that matter: commits acknowledged before they are durable lose
/// appended events in a crash, and too few connections starve the pools.
pub fn postgres_settings_check(settings: &[(String, String)], pool_max: u64) -> Vec<Check> {
    let get = |name: &str| settings.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str());
    let mut checks = Vec::new();
    checks.push(match get("synchronous_commit") {
        Some("off") => Check::warn(
            "synchronous-commit",
            "synchronous_commit is off: a commit the log acknowledged can be lost in a crash",
            "set synchronous_commit = on (or remote_apply/remote_write with a standby)",
        ),
        Some("local") => Check::warn(
            "synchronous-commit",
            "synchronous_commit is local: a commit is acknowledged before any standby has it, so a failover can lose it",
            "set synchronous_commit = on (or remote_apply/remote_write with a standby)",
        ),
        Some(v) => Check::ok("synchronous-commit", format!("synchronous_commit is {v}")),
        None => {
            Check::warn("synchronous-commit", "the server did not report synchronous_commit", "check the database user's rights")
        }
    });
    let wanted = pool_max * POSTGRES_PROCESSES_EXPECTED;
    checks.push(match get("max_connections").and_then(|v| v.parse::<u64>().ok()) {
        Some(max) if max < wanted => Check::warn(
            "max-connections",
            format!("max_connections is {max}: {POSTGRES_PROCESSES_EXPECTED} processes with pools of {pool_max} need {wanted}"),
            format!("raise max_connections to at least {wanted}, or run fewer processes on this database"),
        ),
        Some(max) => Check::ok("max-connections", format!("max_connections is {max} (pools of {pool_max})")),
        None => Check::warn("max-connections", "the server did not report max_connections", "check the database user's rights"),
    });
    if let Some(check) = replication_check(get("synchronous_standby_names"), get("standbys")) {
        checks.push(check);
    }
    checks
}

/// Whether the server acknowledges commits that no standby has yet: standbys streaming while
/// `synchronous_standby_names` is empty replicate asynchronously, and a failover to one of them
/// loses what the log acknowledged last (docs/high-availability.md). `None` when the server did
/// not report them (a backend without replication).
pub fn replication_check(standby_names: Option<&str>, standbys: Option<&str>) -> Option<Check> {
    let standbys: u64 = standbys?.parse().ok()?;
    let names = standby_names?.trim();
    let fix = "Patroni: synchronous_mode: true and synchronous_mode_strict: true; by hand: synchronous_standby_names";
    Some(match (standbys, names.is_empty()) {
        (0, true) => Check::ok("replication", "no standby: the log lives on this one database server"),
        (0, false) => Check::warn(
            "replication",
            format!("synchronous_standby_names is {names:?} but no standby is streaming: every commit waits for one"),
            "start a standby, or see why it does not connect (pg_stat_replication on the primary)",
        ),
        (n, true) => Check::warn(
            "replication",
            format!(
                "{n} standby(s) replicate asynchronously (synchronous_standby_names is empty): a commit is acknowledged \
                 before any standby has it, so a failover can lose it"
            ),
            fix,
        ),
        (n, false) => Check::ok("replication", format!("{n} standby(s); commits wait for {names:?}")),
    })
}

/// A file holding a secret: present and readable by its owner alone. `mode` is `None` when the
/// file is missing.
pub fn key_file_check(name: &'static str, path: &Path, mode: Option<u32>) -> Option<Check> {
    match mode {
        None => Some(Check::fail(
            name,
            format!("{} is missing", path.display()),
            "restore it from your backup; a new one cannot read what the old one signed or sealed",
        )),
        Some(mode) if mode & 0o077 != 0 => Some(Check::fail(
            name,
            format!("{} is mode {:04o}: others can read the secret", path.display(), mode & 0o7777),
            format!("chmod 600 {}", path.display()),
        )),
        Some(_) => None,
    }
}

/// The agents' serving certificate, valid until `not_after_ms`.
pub fn certificate_check(path: &Path, not_after_ms: u64, now_ms: u64) -> Check {
    let fix = format!(
        "make a new certificate (move {} and its key away and restart, or pass --agents-tls-cert/--agents-tls-key), then give agents the new pin",
        path.display()
    );
    let until = bc_core::clock::rfc3339_ms(not_after_ms);
    if not_after_ms <= now_ms {
        Check::fail("agents-certificate", format!("{} expired at {until}", path.display()), fix)
    } else if not_after_ms - now_ms < CERTIFICATE_EXPIRY_WARN_MS {
        Check::warn("agents-certificate", format!("{} expires at {until}", path.display()), fix)
    } else {
        Check::ok("agents-certificate", format!("valid until {until}"))
    }
}

/// Free space on the embedded database's filesystem.
pub fn disk_check(free_bytes: u64, total_bytes: u64) -> Check {
    let share = free_bytes.saturating_mul(1000).checked_div(total_bytes).unwrap_or(0);
    let message = format!("{} MiB free ({}.{}%) beside the database", free_bytes >> 20, share / 10, share % 10);
    let fix = "free space on that filesystem, or move the data directory to a larger one";
    if share < DISK_FREE_FAIL.0 || free_bytes < DISK_FREE_FAIL.1 {
        Check::fail("disk", message, fix)
    } else if share < DISK_FREE_WARN.0 || free_bytes < DISK_FREE_WARN.1 {
        Check::warn("disk", message, fix)
    } else {
        Check::ok("disk", message)
    }
}

/// Each registered reconciler's newest pass, in any process: one that never ran is listed, one
/// whose newest pass is stale or failed warns.
pub fn reconcilers_check(names: &[&str], passes: &[PassRecord], now_ms: u64) -> Check {
    let fix = "start `better-compute serve` (or dev), or `better-compute reconcile`, against this database";
    let mut stale = Vec::new();
    let mut failed = Vec::new();
    let mut never = Vec::new();
    for name in names {
        let newest = passes.iter().filter(|p| p.name == *name).max_by_key(|p| p.started_at_ms + p.duration_ms);
        match newest {
            None => never.push(*name),
            Some(p) if now_ms.saturating_sub(p.started_at_ms + p.duration_ms) > RECONCILER_STALE_MS => stale.push(*name),
            Some(p) if !p.ok => failed.push(format!("{} ({})", name, p.error.as_deref().unwrap_or("failed"))),
            Some(_) => {}
        }
    }
    if never.len() == names.len() {
        return Check::warn("reconcilers", "no reconciler has ever run against this database", fix);
    }
    let never_note = if never.is_empty() { String::new() } else { format!("; never ran: {}", never.join(", ")) };
    if !stale.is_empty() {
        let message = format!("no pass for {} min: {}{never_note}", RECONCILER_STALE_MS / 60_000, stale.join(", "));
        return Check::warn("reconcilers", message, fix);
    }
    if !failed.is_empty() {
        let message = format!("the last pass failed: {}", failed.join("; "));
        return Check::warn("reconcilers", message, "read `better-compute reconcilers status` and the server's log");
    }
    Check::ok(
        "reconcilers",
        format!("{} passed within {} min{never_note}", names.len() - never.len(), RECONCILER_STALE_MS / 60_000),
    )
}

fn mode_of(path: &Path) -> Option<u32> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).ok().map(|m| m.permissions().mode())
}

/// What a doctor run reads besides the database: where the files are.
pub struct Paths<'a> {
    pub data_dir: &'a Path,
    pub data_key: &'a Path,
}

/// Every check, in order. The database's checks are skipped (not failed twice) when it cannot be
/// opened.
pub async fn run(db: &Database, paths: &Paths<'_>) -> Vec<Check> {
    let mut checks = Vec::new();
    let missing = match db {
        Database::Sqlite(path) => (!path.exists()).then(|| format!("no database at {}", path.display())),
        Database::Postgres(_) => None,
    };
    // Opening an embedded database that is not there would make one: doctor writes nothing.
    let opened = match missing {
        Some(message) => Err(CliError::new("NOT_FOUND", message)),
        None => db.open().await,
    };
    let store = match opened {
        Ok(store) => {
            checks.push(Check::ok("database", format!("{} answers", db.describe())));
            Some(store)
        }
        Err(e) => {
            let fix = match db {
                Database::Sqlite(_) => "pass the --data-dir that dev or serve uses",
                Database::Postgres(_) => "start PostgreSQL, or check --database-url (BETTER_COMPUTE_DATABASE_URL)",
            };
            checks.push(Check::fail("database", e.message, fix));
            None
        }
    };
    if let Some(store) = &store {
        database_checks(&**store, db, &mut checks).await;
    }
    checks.extend(log_key_checks(store.as_deref(), paths.data_dir).await);
    checks.extend(data_key_checks(store.as_deref(), paths.data_key).await);
    checks.push(agents_certificate_check(paths.data_dir));
    if let Database::Sqlite(path) = db {
        checks.push(match rustix::fs::statvfs(path.parent().unwrap_or(Path::new("."))) {
            Ok(s) => disk_check(s.f_bavail.saturating_mul(s.f_frsize), s.f_blocks.saturating_mul(s.f_frsize)),
            Err(e) => Check::warn("disk", format!("cannot read the free space: {e}"), "check the data directory exists"),
        });
    }
    checks
}

async fn database_checks(store: &dyn EventStore, db: &Database, checks: &mut Vec<Check>) {
    let latest = store.migrations().last().map(|m| m.version).unwrap_or(0);
    checks.push(match store.schema_version().await {
        Ok(applied) => schema_check(applied, latest),
        Err(e) => Check::fail("schema", e.public_message(), "check the database user can read schema_migrations"),
    });
    if let Database::Postgres(_) = db {
        let sent = SystemClock.now_ms();
        match store.server_facts().await {
            Ok(facts) => {
                let received = SystemClock.now_ms();
                if let Some(db_ms) = facts.now_ms {
                    checks.push(clock_check(sent, received, db_ms));
                }
                checks.extend(postgres_settings_check(&facts.settings, bc_core::store::postgres::POOL_CONNECTIONS_MAX as u64));
            }
            Err(e) => checks.push(Check::warn("clock", e.public_message(), "check the database user's rights")),
        }
    }
    let names: Vec<&str> = bc_reconcilers::registry::NAMES.to_vec();
    checks.push(match store.passes().await {
        Ok(passes) => reconcilers_check(&names, &passes, SystemClock.now_ms()),
        Err(e) => Check::warn("reconcilers", e.public_message(), "check the schema is current"),
    });
}

/// The log key file: present, 0600, loads, and registered in the database (the key its events
/// are signed with).
async fn log_key_checks(store: Option<&dyn EventStore>, data_dir: &Path) -> Vec<Check> {
    let path = data_dir.join(LOG_KEY_FILE);
    if let Some(bad) = key_file_check("log-key", &path, mode_of(&path)) {
        return vec![bad];
    }
    let key = match bc_core::keys::LogKey::load(&path) {
        Ok(key) => key,
        Err(e) => return vec![Check::fail("log-key", e.public_message(), "restore the log key from your backup")],
    };
    let Some(store) = store else {
        return vec![Check::ok("log-key", format!("{} loads (the database was not read)", key.key_id()))];
    };
    match store.signing_keys().await {
        Ok(keys) if keys.iter().any(|(id, _)| id == key.key_id()) => {
            vec![Check::ok("log-key", format!("{} is mode 0600 and registered in the database", key.key_id()))]
        }
        Ok(keys) if keys.is_empty() => vec![Check::warn(
            "log-key",
            format!("{} is not registered yet: no server has signed with it", key.key_id()),
            "start dev or serve once with this data directory",
        )],
        Ok(_) => vec![Check::fail(
            "log-key",
            format!("{} is not a key this database's log was signed with", key.key_id()),
            "pass the --data-dir of this database's servers, or restore its log key",
        )],
        Err(e) => vec![Check::warn("log-key", e.public_message(), "check the schema is current")],
    }
}

/// The data key file: present, 0600, loads, and the key the database's secrets are sealed under.
async fn data_key_checks(store: Option<&dyn EventStore>, path: &Path) -> Vec<Check> {
    if let Some(bad) = key_file_check("data-key", path, mode_of(path)) {
        return vec![bad];
    }
    let key = match bc_core::sealing::DataKey::load(path) {
        Ok(key) => key,
        Err(e) => return vec![Check::fail("data-key", e.public_message(), "restore the data key from your backup")],
    };
    let next = bc_core::sealing::DataKey::load(&bc_core::sealing::data_key_next_path(path)).ok();
    let Some(store) = store else { return vec![Check::ok("data-key", "loads (the database was not read)")] };
    let sealed = match store.secrets_page_raw(None, SECRETS_SAMPLED).await {
        Ok(rows) => rows,
        Err(e) => return vec![Check::warn("data-key", e.public_message(), "check the schema is current")],
    };
    let foreign: std::collections::BTreeSet<&str> = sealed
        .iter()
        .filter_map(|(_, _, stored)| bc_core::sealing::sealed_key_id(stored))
        .filter(|id| *id != key.id() && next.as_ref().is_none_or(|n| n.id() != *id))
        .collect();
    if foreign.is_empty() {
        vec![Check::ok("data-key", format!("mode 0600, and the {} secrets read are sealed under it", sealed.len()))]
    } else {
        let ids: Vec<&str> = foreign.into_iter().collect();
        vec![Check::fail(
            "data-key",
            format!("secrets are sealed under {} , not under this key ({})", ids.join(", "), key.id()),
            "pass the --data-key-file this database's servers use, or restore it",
        )]
    }
}

/// The agents' serving certificate the data directory holds (made at first start); a deployment
/// that passes its own with `--agents-tls-cert` has none here.
fn agents_certificate_check(data_dir: &Path) -> Check {
    use bc_gateway::agents::tls::{SERVING_CERT_FILE, SERVING_KEY_FILE};
    let (cert, key) = (data_dir.join(SERVING_CERT_FILE), data_dir.join(SERVING_KEY_FILE));
    if !cert.exists() {
        return Check::ok(
            "agents-certificate",
            "none in the data directory (made at first start, or given by --agents-tls-cert)",
        );
    }
    if let Some(bad) = key_file_check("agents-certificate", &key, mode_of(&key)) {
        return bad;
    }
    let pem = match std::fs::read(&cert) {
        Ok(pem) => pem,
        Err(e) => return Check::fail("agents-certificate", format!("cannot read {}: {e}", cert.display()), "check its mode"),
    };
    let parsed = x509_parser::pem::parse_x509_pem(&pem)
        .map_err(|e| e.to_string())
        .and_then(|(_, pem)| pem.parse_x509().map(|c| c.validity().not_after.timestamp()).map_err(|e| e.to_string()));
    match parsed {
        Ok(not_after_s) => {
            certificate_check(&cert, u64::try_from(not_after_s).unwrap_or(0).saturating_mul(1000), SystemClock.now_ms())
        }
        Err(e) => {
            Check::fail("agents-certificate", format!("{} does not parse: {e}", cert.display()), "restore it, or make a new one")
        }
    }
}

/// 1 when a check failed, or (`strict`) warned.
pub fn findings(checks: &[Check], strict: bool) -> usize {
    checks.iter().filter(|c| c.status == Status::Fail || (strict && c.status == Status::Warn)).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schema_is_current_behind_or_ahead() {
        assert_eq!(schema_check(Some(7), 7).status, Status::Ok);
        let behind = schema_check(Some(5), 7);
        assert_eq!(behind.status, Status::Fail);
        assert!(behind.message.contains("migrations 6 to 7") && behind.fix.unwrap().contains("better-compute migrate"));
        assert_eq!(schema_check(Some(8), 7).status, Status::Fail);
        assert_eq!(schema_check(None, 7).status, Status::Fail);
    }

    #[test]
    fn the_clock_is_judged_outside_the_calls_round_trip() {
        assert_eq!(clock_check(1_000, 1_500, 1_200).status, Status::Ok, "inside the round trip: no skew");
        assert_eq!(clock_check(10_000, 10_010, 10_010 + CLOCK_SKEW_WARN_MS + 1).status, Status::Warn);
        let behind = clock_check(100_000, 100_010, 100_000 - CLOCK_SKEW_FAIL_MS - 1);
        assert_eq!(behind.status, Status::Fail);
        assert!(behind.message.contains("behind"), "{}", behind.message);
    }

    #[test]
    fn postgres_settings_that_lose_commits_or_starve_pools_warn() {
        let set = |sc: &str, mc: &str| {
            vec![("synchronous_commit".to_owned(), sc.to_owned()), ("max_connections".to_owned(), mc.to_owned())]
        };
        let checks = postgres_settings_check(&set("on", "100"), 16);
        assert!(checks.iter().all(|c| c.status == Status::Ok), "{checks:?}");
        let checks = postgres_settings_check(&set("off", "20"), 16);
        assert!(checks.iter().all(|c| c.status == Status::Warn), "{checks:?}");
        assert!(checks[1].message.contains("need 64"), "{}", checks[1].message);
    }

    #[test]
    fn commits_no_standby_has_yet_warn() {
        let check = |names: &str, standbys: &str| replication_check(Some(names), Some(standbys)).unwrap();
        assert_eq!(check("", "0").status, Status::Ok, "one server, nothing to wait for");
        let asynchronous = check("", "2");
        assert_eq!(asynchronous.status, Status::Warn);
        assert!(asynchronous.message.contains("asynchronously"), "{}", asynchronous.message);
        assert_eq!(check("\"member-1\"", "2").status, Status::Ok);
        assert_eq!(check("*", "0").status, Status::Warn, "commits wait for a standby that is not there");
        assert!(replication_check(None, Some("1")).is_none() && replication_check(Some(""), None).is_none());
        let local =
            postgres_settings_check(&[("synchronous_commit".to_owned(), "local".to_owned())], 16).into_iter().next().unwrap();
        assert_eq!(local.status, Status::Warn);
        assert!(local.message.contains("before any standby"), "{}", local.message);
    }

    #[test]
    fn a_key_file_others_can_read_fails_with_the_chmod() {
        let path = Path::new("/data/data.key");
        assert!(key_file_check("data-key", path, Some(0o100600)).is_none());
        let open = key_file_check("data-key", path, Some(0o100644)).unwrap();
        assert_eq!(open.status, Status::Fail);
        assert_eq!(open.fix.as_deref(), Some("chmod 600 /data/data.key"));
        assert!(open.message.contains("0644"), "{}", open.message);
        assert_eq!(key_file_check("data-key", path, None).unwrap().status, Status::Fail);
    }

    #[test]
    fn certificates_and_disks_warn_before_they_fail() {
        let day = 24 * 3600 * 1000;
        let path = Path::new("agents-tls.crt");
        assert_eq!(certificate_check(path, 400 * day, 0).status, Status::Ok);
        assert_eq!(certificate_check(path, 10 * day, 0).status, Status::Warn);
        assert_eq!(certificate_check(path, day, 2 * day).status, Status::Fail);
        let gib = 1u64 << 30;
        assert_eq!(disk_check(50 * gib, 100 * gib).status, Status::Ok);
        assert_eq!(disk_check(5 * gib, 100 * gib).status, Status::Warn);
        assert_eq!(disk_check(gib / 2, 100 * gib).status, Status::Fail);
        assert_eq!(disk_check(0, 0).status, Status::Fail);
    }

    fn pass(name: &str, at: u64, ok: bool) -> PassRecord {
        PassRecord {
            name: name.into(),
            instance: "host:1".into(),
            started_at_ms: at,
            duration_ms: 5,
            ok,
            counts: Default::default(),
            error: (!ok).then(|| "boom".into()),
            passes: 1,
        }
    }

    #[test]
    fn a_witness_unreachable_fails_and_one_not_cosigning_warns() {
        let url = "http://127.0.0.1:1";
        let down = witness_check("w1", url, Err("cannot connect: refused".into()), Some((7, true)));
        assert_eq!(down.status, Status::Fail);
        assert!(down.message.contains("w1 at http://127.0.0.1:1: cannot connect"), "{}", down.message);
        assert_eq!(witness_check("w1", url, Ok(()), None).status, Status::Ok);
        assert_eq!(witness_check("w1", url, Ok(()), Some((7, true))).status, Status::Ok);
        let silent = witness_check("w1", url, Ok(()), Some((7, false)));
        assert_eq!(silent.status, Status::Warn);
        assert!(silent.message.contains("size 7"), "{}", silent.message);
    }

    #[test]
    fn reconcilers_never_run_stale_or_failing() {
        let names = ["a", "b"];
        let now = 10 * RECONCILER_STALE_MS;
        assert_eq!(reconcilers_check(&names, &[], now).status, Status::Warn);
        let fresh = [pass("a", now - 1000, true), pass("b", now - 1000, true)];
        assert_eq!(reconcilers_check(&names, &fresh, now).status, Status::Ok);
        let check = reconcilers_check(&names, &[pass("a", now - 1000, true)], now);
        assert_eq!(check.status, Status::Ok, "one never ran is listed, not a warning");
        assert!(check.message.contains("never ran: b"), "{}", check.message);
        let stale = reconcilers_check(&names, &[pass("a", 0, true), pass("b", now - 1000, true)], now);
        assert_eq!(stale.status, Status::Warn);
        assert!(stale.message.contains(": a"), "{}", stale.message);
        let failed = reconcilers_check(&names, &[pass("a", now - 10, false), pass("b", now - 10, true)], now);
        assert_eq!(failed.status, Status::Warn);
        assert!(failed.message.contains("a (boom)"), "{}", failed.message);
        assert_eq!(findings(std::slice::from_ref(&failed), false), 0);
        assert_eq!(findings(&[failed], true), 1);
    }
}
