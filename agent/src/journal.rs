//! The journal: a local SQLite file (`journal.db` in `data_dir`) where every observation and
//! command result is written first, hash-chained and signed by the node key, then sent. An entry
//! leaves only when the gateway acknowledges it; acknowledged entries are pruned past
//! `ACKED_KEEP`. Unacknowledged entries are bounded (`unacked_max`): at the bound `append`
//! refuses with [`JournalError::Full`] and the caller says so; nothing is ever dropped silently.
//!
//! The file names its node: a journal of another node is refused. WAL with `synchronous=FULL`:
//! an entry that `append` returned survives a SIGKILL and a power cut.

use std::path::Path;
use std::time::Duration;

use bc_core::agent::{EntryBody, GENESIS_HASH, SignedEntry};
use bc_core::id::NodeId;
use ed25519_dalek::SigningKey;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Row, SqlitePool};

pub const JOURNAL_FILE: &str = "journal.db";
/// Unacknowledged entries the journal holds at most, by default.
pub const UNACKED_MAX_DEFAULT: u64 = 100_000;
/// Acknowledged entries kept for `bcd status` and forensics; older ones are pruned.
pub const ACKED_KEEP: u64 = 1_000;
/// Entries read for one send at most.
pub const READ_ENTRIES_MAX: u32 = 256;

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("the journal holds {0} unacknowledged entries (its bound); nothing more is written until the gateway acknowledges")]
    Full(u64),
    #[error("this journal belongs to node {found}, not {expected}")]
    OtherNode { found: String, expected: String },
    #[error("journal: {0}")]
    Storage(String),
}

impl From<sqlx::Error> for JournalError {
    fn from(e: sqlx::Error) -> Self {
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
    pool: SqlitePool,
    node: NodeId,
    unacked_max: u64,
}

const SCHEMA: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS entries (seq INTEGER PRIMARY KEY, hash BLOB NOT NULL, body BLOB NOT NULL, \
     signature BLOB NOT NULL, acked INTEGER NOT NULL DEFAULT 0)",
    "CREATE TABLE IF NOT EXISTS commands (command_id TEXT PRIMARY KEY, stage TEXT NOT NULL)",
    // The newest acknowledged sequence, kept apart from the entries so pruning never loses it.
    "CREATE TABLE IF NOT EXISTS acked (id INTEGER PRIMARY KEY CHECK (id = 1), seq INTEGER NOT NULL)",
];

impl Journal {
    /// Opens (creating it 0600 if needed) the journal of `node` at `path`.
    pub async fn open(path: &Path, node: NodeId, unacked_max: u64) -> Result<Self, JournalError> {
        if !path.exists() {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(path)
                .map_err(|e| JournalError::Storage(format!("creating {}: {e}", path.display())))?;
        }
        let options = SqliteConnectOptions::new()
            .filename(path)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_secs(5));
        // One connection: the journal has one writer, and appends are serialized by it.
        let pool = SqlitePoolOptions::new().max_connections(1).connect_with(options).await?;
        for statement in SCHEMA {
            sqlx::query(*statement).execute(&pool).await?;
        }
        sqlx::query("INSERT INTO meta (key, value) VALUES ('node', ?) ON CONFLICT (key) DO NOTHING")
            .bind(node.to_string())
            .execute(&pool)
            .await?;
        let found: String = sqlx::query("SELECT value FROM meta WHERE key = 'node'").fetch_one(&pool).await?.get(0);
        if found != node.to_string() {
            return Err(JournalError::OtherNode { found, expected: node.to_string() });
        }
        sqlx::query("INSERT INTO acked (id, seq) VALUES (1, 0) ON CONFLICT (id) DO NOTHING").execute(&pool).await?;
        Ok(Self { pool, node, unacked_max })
    }

    /// The node a journal file names, read without writing (`bcd doctor`); `Ok(None)`: no file.
    pub async fn owner(path: &Path) -> Result<Option<String>, JournalError> {
        if !path.exists() {
            return Ok(None);
        }
        let options = SqliteConnectOptions::new().filename(path).read_only(true).busy_timeout(Duration::from_secs(5));
        let pool = SqlitePoolOptions::new().max_connections(1).connect_with(options).await?;
        let found = sqlx::query("SELECT value FROM meta WHERE key = 'node'").fetch_optional(&pool).await;
        pool.close().await;
        Ok(found?.map(|row| row.get(0)))
    }

    /// The newest entry's sequence and hash (0 and the genesis hash: none).
    pub async fn head(&self) -> Result<(u64, [u8; 32]), JournalError> {
        let row = sqlx::query("SELECT seq, hash FROM entries ORDER BY seq DESC LIMIT 1").fetch_optional(&self.pool).await?;
        Ok(match row {
            None => (self.acked().await?, GENESIS_HASH),
            Some(row) => {
                let hash: Vec<u8> = row.get(1);
                (
                    row.get::<i64, _>(0) as u64,
                    hash.try_into().map_err(|_| JournalError::Storage("a stored hash is not 32 bytes".into()))?,
                )
            }
        })
    }

    pub async fn acked(&self) -> Result<u64, JournalError> {
        Ok(sqlx::query("SELECT seq FROM acked WHERE id = 1").fetch_one(&self.pool).await?.get::<i64, _>(0) as u64)
    }

    pub async fn unacked(&self) -> Result<u64, JournalError> {
        Ok(sqlx::query("SELECT COUNT(*) FROM entries WHERE acked = 0").fetch_one(&self.pool).await?.get::<i64, _>(0) as u64)
    }

    /// Numbers, links, signs and stores `draft`; durable when this returns.
    pub async fn append(&self, key: &SigningKey, draft: Draft) -> Result<SignedEntry, JournalError> {
        let mut tx = self.pool.begin().await?;
        let unacked: i64 = sqlx::query("SELECT COUNT(*) FROM entries WHERE acked = 0").fetch_one(&mut *tx).await?.get(0);
        if unacked as u64 >= self.unacked_max {
            return Err(JournalError::Full(unacked as u64));
        }
        let head = sqlx::query("SELECT seq, hash FROM entries ORDER BY seq DESC LIMIT 1").fetch_optional(&mut *tx).await?;
        let (seq, prev) = match head {
            Some(row) => {
                let hash: Vec<u8> = row.get(1);
                (
                    row.get::<i64, _>(0) as u64 + 1,
                    hash.try_into().map_err(|_| JournalError::Storage("a stored hash is not 32 bytes".into()))?,
                )
            }
            None => {
                // Everything was pruned or nothing was written: continue after the acked head.
                let acked: i64 = sqlx::query("SELECT seq FROM acked WHERE id = 1").fetch_one(&mut *tx).await?.get(0);
                if acked > 0 {
                    return Err(JournalError::Storage(
                        "the journal lost its newest entry's hash (every entry was pruned)".into(),
                    ));
                }
                (1, GENESIS_HASH)
            }
        };
        let body = EntryBody {
            node: self.node,
            seq,
            prev,
            at_ms: draft.at_ms,
            entry_type: draft.entry_type,
            subject: draft.subject,
            payload: draft.payload,
        };
        let entry = SignedEntry::sign(key, &body)?;
        sqlx::query("INSERT INTO entries (seq, hash, body, signature) VALUES (?, ?, ?, ?)")
            .bind(seq as i64)
            .bind(entry.hash.to_vec())
            .bind(entry.body.clone())
            .bind(entry.signature.to_vec())
            .execute(&mut *tx)
            .await?;
        if let Some((command, stage)) = draft.command {
            let stage = match stage {
                Stage::Started => "started",
                Stage::Finished => "finished",
            };
            sqlx::query("INSERT INTO commands (command_id, stage) VALUES (?, ?) ON CONFLICT (command_id) DO UPDATE SET stage = excluded.stage")
                .bind(command)
                .bind(stage)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(entry)
    }

    /// The entries after `seq`, oldest first, at most `limit`.
    pub async fn after(&self, seq: u64, limit: u32) -> Result<Vec<SignedEntry>, JournalError> {
        let rows = sqlx::query("SELECT seq, hash, body, signature FROM entries WHERE seq > ? ORDER BY seq LIMIT ?")
            .bind(seq as i64)
            .bind(i64::from(limit.min(READ_ENTRIES_MAX)))
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|row| {
                let bad = || JournalError::Storage("a stored entry is malformed".into());
                Ok(SignedEntry {
                    seq: row.get::<i64, _>(0) as u64,
                    hash: row.get::<Vec<u8>, _>(1).try_into().map_err(|_| bad())?,
                    body: row.get(2),
                    signature: row.get::<Vec<u8>, _>(3).try_into().map_err(|_| bad())?,
                })
            })
            .collect()
    }

    /// Marks every entry up to `seq` acknowledged and prunes the acknowledged ones past
    /// [`ACKED_KEEP`] (the newest entry always stays: it is the chain's link).
    pub async fn ack(&self, seq: u64) -> Result<(), JournalError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("UPDATE entries SET acked = 1 WHERE seq <= ? AND acked = 0").bind(seq as i64).execute(&mut *tx).await?;
        sqlx::query("UPDATE acked SET seq = MAX(seq, ?) WHERE id = 1").bind(seq as i64).execute(&mut *tx).await?;
        sqlx::query(
            "DELETE FROM entries WHERE acked = 1 AND seq <= (SELECT MAX(seq) FROM entries) - ? \
             AND seq < (SELECT MAX(seq) FROM entries)",
        )
        .bind(ACKED_KEEP as i64)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// How far `command` got in this journal.
    pub async fn command_stage(&self, command: &str) -> Result<Option<Stage>, JournalError> {
        let row = sqlx::query("SELECT stage FROM commands WHERE command_id = ?").bind(command).fetch_optional(&self.pool).await?;
        Ok(row.map(|r| if r.get::<String, _>(0) == "started" { Stage::Started } else { Stage::Finished }))
    }

    pub async fn close(self) {
        self.pool.close().await;
    }
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
