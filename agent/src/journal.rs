//! The journal: a local SQLite file (`journal.db` in `data_dir`) where every observation and
//! command result is written first, hash-chained and signed by the node key, then sent. An entry
//! leaves only when the gateway acknowledges it; acknowledged entries are pruned past
//! `ACKED_KEEP`. Unacknowledged entries are bounded (`unacked_max`): at the bound `append`
//! refuses with [`JournalError::Full`] and the caller says so; nothing is ever dropped silently.
//!
//! The file names its node: a journal of another node is refused. WAL with `synchronous=FULL`:
//! an entry that `append` returned survives a SIGKILL and a power cut.
//!
//! One connection (rusqlite), one writer. `bcd` runs each call on tokio's blocking threads, so a
//! commit's fsync never holds a runtime thread; the simulator, whose one thread is the whole
//! world and which runs a thousand agents, opens it with [`Journal::open_for_one_thread`] and the
//! same statements run on the caller's thread (a thread per journal, woken per statement, was
//! a fifth of a 1,000-node run).

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bc_core::agent::{EntryBody, GENESIS_HASH, SignedEntry};
use bc_core::id::NodeId;
use ed25519_dalek::SigningKey;
use rusqlite::{Connection, OpenFlags, OptionalExtension, params};

pub const JOURNAL_FILE: &str = "journal.db";
/// Unacknowledged entries the journal holds at most, by default.
pub const UNACKED_MAX_DEFAULT: u64 = 100_000;
/// Acknowledged entries kept for `bcd status` and forensics; older ones are pruned.
pub const ACKED_KEEP: u64 = 1_000;
/// Entries read for one send at most.
pub const READ_ENTRIES_MAX: u32 = 256;
/// How long a statement waits for the file's lock (another process reading it: `bcd doctor`).
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("the journal holds {0} unacknowledged entries (its bound); nothing more is written until the gateway acknowledges")]
    Full(u64),
    #[error("this journal belongs to node {found}, not {expected}")]
    OtherNode { found: String, expected: String },
    #[error("journal: {0}")]
    Storage(String),
}

impl From<rusqlite::Error> for JournalError {
    fn from(e: rusqlite::Error) -> Self {
        Self::Storage(e.to_string())
    }
}

impl From<bc_core::Error> for JournalError {
    fn from(e: bc_core::Error) -> Self {
        Self::Storage(e.to_string())
    }
}

/// What a command has reached in this journal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Started,
    Finished,
}

/// An entry to write: what it says; the journal numbers, links and signs it.
#[derive(Clone, Debug)]
pub struct Draft {
    pub at_ms: u64,
    pub entry_type: String,
    pub subject: String,
    pub payload: serde_json::Value,
    /// The command this entry reports on, and how far it got.
    pub command: Option<(String, Stage)>,
}

pub struct Journal {
    conn: Arc<Mutex<Connection>>,
    node: NodeId,
    unacked_max: u64,
    /// Statements run on the caller's thread (the simulator), not on a blocking thread.
    inline: bool,
}

const SCHEMA: &str = "
    CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE IF NOT EXISTS entries (seq INTEGER PRIMARY KEY, hash BLOB NOT NULL, body BLOB NOT NULL,
        signature BLOB NOT NULL, acked INTEGER NOT NULL DEFAULT 0);
    CREATE TABLE IF NOT EXISTS commands (command_id TEXT PRIMARY KEY, stage TEXT NOT NULL);
    -- The newest acknowledged sequence, kept apart from the entries so pruning never loses it.
    CREATE TABLE IF NOT EXISTS acked (id INTEGER PRIMARY KEY CHECK (id = 1), seq INTEGER NOT NULL);
    INSERT INTO acked (id, seq) VALUES (1, 0) ON CONFLICT (id) DO NOTHING;
";

fn hash32(bytes: Vec<u8>) -> Result<[u8; 32], JournalError> {
    bytes.try_into().map_err(|_| JournalError::Storage("a stored hash is not 32 bytes".into()))
}

/// The newest entry's sequence and hash, if any entry is left.
fn newest(conn: &Connection) -> Result<Option<(u64, [u8; 32])>, JournalError> {
    let row = conn
        .prepare_cached("SELECT seq, hash FROM entries ORDER BY seq DESC LIMIT 1")?
        .query_row([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, Vec<u8>>(1)?)))
        .optional()?;
    row.map(|(seq, hash)| Ok((seq as u64, hash32(hash)?))).transpose()
}

fn acked_on(conn: &Connection) -> Result<u64, JournalError> {
    Ok(conn.prepare_cached("SELECT seq FROM acked WHERE id = 1")?.query_row([], |r| r.get::<_, i64>(0))? as u64)
}

fn unacked_on(conn: &Connection) -> Result<u64, JournalError> {
    Ok(conn.prepare_cached("SELECT COUNT(*) FROM entries WHERE acked = 0")?.query_row([], |r| r.get::<_, i64>(0))? as u64)
}

impl Journal {
    /// Opens (creating it 0600 if needed) the journal of `node` at `path`.
    pub async fn open(path: &Path, node: NodeId, unacked_max: u64) -> Result<Self, JournalError> {
        let path = path.to_owned();
        let conn = tokio::task::spawn_blocking(move || Self::connect(&path, node, None))
            .await
            .map_err(|e| JournalError::Storage(format!("opening the journal: {e}")))??;
        Ok(Self { conn: Arc::new(Mutex::new(conn)), node, unacked_max, inline: false })
    }

    /// [`Self::open`] for a process whose one thread is the whole world (the simulator): every
    /// statement runs on the caller's thread, and the file is opened through SQLite's
    /// `unix-excl` VFS ([`bc_core::store::sqlite::ONE_PROCESS_VFS`]): locked once against
    /// other processes, its locks between this process's connections kept in memory, so a
    /// write makes no `fcntl` calls.
    pub fn open_for_one_thread(path: &Path, node: NodeId, unacked_max: u64) -> Result<Self, JournalError> {
        let conn = Self::connect(path, node, Some(bc_core::store::sqlite::ONE_PROCESS_VFS))?;
        Ok(Self { conn: Arc::new(Mutex::new(conn)), node, unacked_max, inline: true })
    }

    /// `vfs`: SQLite's VFS to open it through (`None`: the platform's default).
    fn connect(path: &Path, node: NodeId, vfs: Option<&str>) -> Result<Connection, JournalError> {
        if !path.exists() {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(path)
                .map_err(|e| JournalError::Storage(format!("creating {}: {e}", path.display())))?;
        }
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = match vfs {
            Some(vfs) => Connection::open_with_flags_and_vfs(path, flags, vfs)?,
            None => Connection::open_with_flags(path, flags)?,
        };
        conn.busy_timeout(BUSY_TIMEOUT)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.execute_batch(SCHEMA)?;
        conn.execute("INSERT INTO meta (key, value) VALUES ('node', ?1) ON CONFLICT (key) DO NOTHING", [node.to_string()])?;
        let found: String = conn.query_row("SELECT value FROM meta WHERE key = 'node'", [], |r| r.get(0))?;
        if found != node.to_string() {
            return Err(JournalError::OtherNode { found, expected: node.to_string() });
        }
        Ok(conn)
    }

    /// Runs `work` on the connection: on a blocking thread, or here when opened for one thread.
    async fn with<T: Send + 'static>(
        &self,
        work: impl FnOnce(&mut Connection) -> Result<T, JournalError> + Send + 'static,
    ) -> Result<T, JournalError> {
        let conn = self.conn.clone();
        let run = move || {
            let mut conn = conn.lock().map_err(|_| JournalError::Storage("the journal's connection is poisoned".into()))?;
            work(&mut conn)
        };
        if self.inline {
            return run();
        }
        tokio::task::spawn_blocking(run).await.map_err(|e| JournalError::Storage(format!("the journal's thread: {e}")))?
    }

    /// The node a journal file names, read without writing (`bcd doctor`); `Ok(None)`: no file.
    pub async fn owner(path: &Path) -> Result<Option<String>, JournalError> {
        if !path.exists() {
            return Ok(None);
        }
        let path = path.to_owned();
        tokio::task::spawn_blocking(move || {
            let conn = Connection::open_with_flags(&path, OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX)?;
            conn.busy_timeout(BUSY_TIMEOUT)?;
            Ok(conn.query_row("SELECT value FROM meta WHERE key = 'node'", [], |r| r.get(0)).optional()?)
        })
        .await
        .map_err(|e| JournalError::Storage(format!("reading the journal: {e}")))?
    }

    /// The newest entry's sequence and hash (the acknowledged head and the genesis hash: none).
    pub async fn head(&self) -> Result<(u64, [u8; 32]), JournalError> {
        self.with(|conn| match newest(conn)? {
            Some(head) => Ok(head),
            None => Ok((acked_on(conn)?, GENESIS_HASH)),
        })
        .await
    }

    pub async fn acked(&self) -> Result<u64, JournalError> {
        self.with(|conn| acked_on(conn)).await
    }

    pub async fn unacked(&self) -> Result<u64, JournalError> {
        self.with(|conn| unacked_on(conn)).await
    }

    /// Numbers, links, signs and stores `draft`; durable when this returns.
    pub async fn append(&self, key: &SigningKey, draft: Draft) -> Result<SignedEntry, JournalError> {
        let (key, node, unacked_max) = (key.clone(), self.node, self.unacked_max);
        self.with(move |conn| {
            let tx = conn.transaction()?;
            let unacked = unacked_on(&tx)?;
            if unacked >= unacked_max {
                return Err(JournalError::Full(unacked));
            }
            let (seq, prev) = match newest(&tx)? {
                Some((seq, hash)) => (seq + 1, hash),
                None => {
                    // Everything was pruned or nothing was written: continue after the acked head.
                    if acked_on(&tx)? > 0 {
                        return Err(JournalError::Storage(
                            "the journal lost its newest entry's hash (every entry was pruned)".into(),
                        ));
                    }
                    (1, GENESIS_HASH)
                }
            };
            let body = EntryBody {
                node,
                seq,
                prev,
                at_ms: draft.at_ms,
                entry_type: draft.entry_type,
                subject: draft.subject,
                payload: draft.payload,
            };
            let entry = SignedEntry::sign(&key, &body)?;
            tx.prepare_cached("INSERT INTO entries (seq, hash, body, signature) VALUES (?1, ?2, ?3, ?4)")?.execute(params![
                seq as i64,
                &entry.hash[..],
                &entry.body,
                &entry.signature[..]
            ])?;
            if let Some((command, stage)) = draft.command {
                let stage = match stage {
                    Stage::Started => "started",
                    Stage::Finished => "finished",
                };
                tx.prepare_cached(
                    "INSERT INTO commands (command_id, stage) VALUES (?1, ?2) ON CONFLICT (command_id) DO UPDATE SET stage = excluded.stage",
                )?
                .execute(params![command, stage])?;
            }
            tx.commit()?;
            Ok(entry)
        })
        .await
    }

    /// The entries after `seq`, oldest first, at most `limit`.
    pub async fn after(&self, seq: u64, limit: u32) -> Result<Vec<SignedEntry>, JournalError> {
        self.with(move |conn| {
            let mut statement =
                conn.prepare_cached("SELECT seq, hash, body, signature FROM entries WHERE seq > ?1 ORDER BY seq LIMIT ?2")?;
            let rows = statement.query_map(params![seq as i64, i64::from(limit.min(READ_ENTRIES_MAX))], |r| {
                Ok((r.get::<_, i64>(0)?, r.get::<_, Vec<u8>>(1)?, r.get::<_, Vec<u8>>(2)?, r.get::<_, Vec<u8>>(3)?))
            })?;
            rows.map(|row| {
                let (seq, hash, body, signature) = row?;
                let bad = || JournalError::Storage("a stored entry is malformed".into());
                Ok(SignedEntry {
                    seq: seq as u64,
                    hash: hash.try_into().map_err(|_| bad())?,
                    body,
                    signature: signature.try_into().map_err(|_| bad())?,
                })
            })
            .collect()
        })
        .await
    }

    /// Marks every entry up to `seq` acknowledged and prunes the acknowledged ones past
    /// [`ACKED_KEEP`] (the newest entry always stays: it is the chain's link).
    pub async fn ack(&self, seq: u64) -> Result<(), JournalError> {
        self.with(move |conn| {
            let tx = conn.transaction()?;
            tx.prepare_cached("UPDATE entries SET acked = 1 WHERE seq <= ?1 AND acked = 0")?.execute([seq as i64])?;
            tx.prepare_cached("UPDATE acked SET seq = MAX(seq, ?1) WHERE id = 1")?.execute([seq as i64])?;
            tx.prepare_cached(
                "DELETE FROM entries WHERE acked = 1 AND seq <= (SELECT MAX(seq) FROM entries) - ?1 \
                 AND seq < (SELECT MAX(seq) FROM entries)",
            )?
            .execute([ACKED_KEEP as i64])?;
            tx.commit()?;
            Ok(())
        })
        .await
    }

    /// How far `command` got in this journal.
    pub async fn command_stage(&self, command: &str) -> Result<Option<Stage>, JournalError> {
        let command = command.to_owned();
        self.with(move |conn| {
            let stage: Option<String> = conn
                .prepare_cached("SELECT stage FROM commands WHERE command_id = ?1")?
                .query_row([command], |r| r.get(0))
                .optional()?;
            Ok(stage.map(|s| if s == "started" { Stage::Started } else { Stage::Finished }))
        })
        .await
    }

    /// Closes the file (dropping the journal does too); for symmetry with `open`.
    pub async fn close(self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draft(n: u64) -> Draft {
        Draft {
            at_ms: n,
            entry_type: "node.observed".into(),
            subject: "agent/node_01jd0000000000000000000000".into(),
            payload: serde_json::json!({ "n": n }),
            command: None,
        }
    }

    #[tokio::test]
    async fn entries_chain_and_survive_reopening_and_pruning_keeps_the_link() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(JOURNAL_FILE);
        let node = NodeId::from_ulid(ulid::Ulid::from_parts(1, 1));
        let key = SigningKey::from_bytes(&[3; 32]);
        let journal = Journal::open(&path, node, 10).await.unwrap();
        let first = journal.append(&key, draft(1)).await.unwrap();
        let second = journal.append(&key, draft(2)).await.unwrap();
        let (body, _) = SignedEntry::verify(2, &second.body, &second.signature, &key.verifying_key()).unwrap();
        assert_eq!(body.prev, first.hash);
        journal.close().await;
        let journal = Journal::open(&path, node, 10).await.unwrap();
        assert_eq!(journal.head().await.unwrap(), (2, second.hash));
        journal.ack(2).await.unwrap();
        assert_eq!(journal.unacked().await.unwrap(), 0);
        let third = journal.append(&key, draft(3)).await.unwrap();
        let (body, _) = SignedEntry::verify(3, &third.body, &third.signature, &key.verifying_key()).unwrap();
        assert_eq!(body.prev, second.hash);
        let other = NodeId::from_ulid(ulid::Ulid::from_parts(2, 2));
        journal.close().await;
        assert!(matches!(Journal::open(&path, other, 10).await, Err(JournalError::OtherNode { .. })));
    }

    #[tokio::test]
    async fn a_full_journal_refuses_and_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let node = NodeId::from_ulid(ulid::Ulid::from_parts(1, 1));
        let key = SigningKey::from_bytes(&[3; 32]);
        let journal = Journal::open(&dir.path().join(JOURNAL_FILE), node, 2).await.unwrap();
        journal.append(&key, draft(1)).await.unwrap();
        journal.append(&key, draft(2)).await.unwrap();
        assert!(matches!(journal.append(&key, draft(3)).await, Err(JournalError::Full(2))));
        journal.ack(1).await.unwrap();
        journal.append(&key, draft(3)).await.unwrap();
        assert_eq!(journal.after(0, 10).await.unwrap().len(), 3);
    }
}
