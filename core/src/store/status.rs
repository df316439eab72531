//! What each reconciler did last, per process: omicron's background-task status. Every pass of
//! a reconciler (a reservations pass, a batch of deliveries, a round of sealing) is recorded as
//! that reconciler's last pass in its process, with its outcome and counts; `better-compute
//! reconcilers status` reads them. Operational state, not the log: losing it loses no event.

use std::collections::BTreeMap;

use async_trait::async_trait;
use serde::Serialize;

use super::Store;
use crate::error::{Error, Result};

/// How long a process's rows stay after its last pass: a process gone for this long is gone.
pub const PASS_FORGET_MS: u64 = 7 * 24 * 3600 * 1000;
/// Counts one pass records at most, and the longest error kept.
pub const PASS_COUNTS_MAX: usize = 16;
pub const PASS_ERROR_CHARS_MAX: usize = 500;

/// One reconciler's last pass in one process.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PassRecord {
    /// The reconciler (`reservations`, `webhooks`, `checkpoints`).
    pub name: String,
    /// The process: `HOST:PID` and when it started, so a restart is a new instance.
    pub instance: String,
    pub started_at_ms: u64,
    pub duration_ms: u64,
    /// The pass did what it set out to; `false` with `error` when it failed.
    pub ok: bool,
    /// What the pass did (`expired`, `activated`, `delivered`, `sealed`, …).
    pub counts: BTreeMap<String, u64>,
    pub error: Option<String>,
    /// Passes this process has made so far. When recording: the passes since the last record
    /// (a busy reconciler records at most once a second, `counts` summed over those passes).
    pub passes: u64,
}

impl PassRecord {
    pub(crate) fn counts_json(&self) -> Result<String> {
        if self.counts.len() > PASS_COUNTS_MAX {
            return Err(Error::Internal(format!("a pass records at most {PASS_COUNTS_MAX} counts")));
        }
        serde_json::to_string(&self.counts).map_err(|e| Error::Internal(format!("pass counts: {e}")))
    }

    pub(crate) fn error_text(&self) -> Option<String> {
        self.error.as_deref().map(|e| crate::id::truncate(e, PASS_ERROR_CHARS_MAX))
    }

    /// A pass from a row of [`PASS_COLUMNS`].
    pub(crate) fn decode(row: &(impl super::Columns + ?Sized)) -> Result<Self> {
        let (name, instance) = (row.text(0)?, row.text(1)?);
        let counts = serde_json::from_str(&row.text(6)?)
            .map_err(|e| Error::Storage(format!("reconciler pass {name}/{instance}: counts: {e}")))?;
        Ok(Self {
            started_at_ms: super::to_u64(row.int(2)?)?,
            duration_ms: super::to_u64(row.int(3)?)?,
            ok: row.int(4)? != 0,
            passes: super::to_u64(row.int(5)?)?,
            counts,
            error: row.opt_text(7)?,
            name,
            instance,
        })
    }
}

/// The columns a pass is read from, in [`PassRecord::decode`]'s order.
pub(crate) const PASS_COLUMNS: &str = "name, instance, started_at_ms, duration_ms, ok, passes, counts, error";

#[async_trait]
pub trait StatusStore: Store {
    /// Records `pass` as its reconciler's last in its process (its `passes` added to the count
    /// so far), and forgets the processes whose last pass began before `forget_before_ms`.
    async fn pass_record(&self, pass: &PassRecord, forget_before_ms: u64) -> Result<()>;
    /// Every reconciler's last pass in every process, by name then instance.
    async fn passes(&self) -> Result<Vec<PassRecord>>;
}
