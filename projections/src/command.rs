//! Commands to nodes (`command/cmd_…`): the document, its state, the node's queue of unfinished
//! commands, the payloads of `command.*`, and their fold.
//!
//! A command is `issued`, then `started`, then finished once: `succeeded`, `failed` (also when
//! its deadline passes) or `cancelled`; a report on a finished command is kept in the log but
//! does not reopen it. A node's GPU and instance reports finish their command too, from their
//! own streams. A node has at most [`COMMANDS_PENDING_PER_NODE_MAX`] unfinished commands of a
//! caller's; the control plane's own GPU and instance commands are bounded elsewhere.

use bc_core::event::StoredEvent;
use bc_core::store::RowKey;
use bc_core::{Error, Result, canonical};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::instance::INSTANCE_APPLY;
use crate::node::{KIND_NODE, NodeDoc, advance_journal};
use crate::{corrupt, from_doc, payload, state_from_str, to_doc};

pub const COMMAND_ISSUED: &str = "command.issued";
pub const COMMAND_CANCELLED: &str = "command.cancelled";
pub const COMMAND_STARTED: &str = "command.started";
pub const COMMAND_SUCCEEDED: &str = "command.succeeded";
pub const COMMAND_FAILED: &str = "command.failed";

/// A command to a node.
pub const KIND_COMMAND: &str = "command";
/// One row per unfinished command (removed when it ends): what the deadline sweep scans.
pub const KIND_COMMAND_LIVE: &str = "command_live";
/// One row per node: the node's unfinished commands in issue order, what its session delivers.
pub const KIND_NODE_COMMANDS: &str = "node_commands";
/// Unfinished commands one node may have: a node that is away for long cannot pile up more.
pub const COMMANDS_PENDING_PER_NODE_MAX: usize = 256;

/// A command's state: `issued` (waiting for the node), `started`, then `succeeded`, `failed`
/// (with a reason; also when its deadline passed) or `cancelled`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum CommandState {
    Issued,
    Started,
    Succeeded,
    Failed,
    Cancelled,
}

impl CommandState {
    pub const ALL: &[Self] = &[Self::Issued, Self::Started, Self::Succeeded, Self::Failed, Self::Cancelled];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Issued => "issued",
            Self::Started => "started",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }

    pub fn is_finished(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Cancelled)
    }
}

impl std::str::FromStr for CommandState {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        state_from_str("command", text, Self::ALL, Self::as_str)
    }
}

/// A command document.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CommandDoc {
    pub tenant_id: String,
    pub command_id: String,
    pub node_id: String,
    pub kind: String,
    pub args: Value,
    pub state: CommandState,
    pub reason: Option<String>,
    pub result: Option<Value>,
    pub issued_by: String,
    pub issued_at_ms: u64,
    pub deadline_at_ms: u64,
    pub started_at_ms: Option<u64>,
    pub finished_at_ms: Option<u64>,
    /// The journal entries of the node that reported on it.
    pub journal_seqs: Vec<u64>,
    pub version: u64,
    /// A command of a released batch: the release its node checks itself
    /// (`bc_core::approval::verify_release`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release: Option<bc_core::approval::BatchRelease>,
}

/// A node's unfinished commands, oldest first: what its session sends.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NodeCommandsDoc {
    pub pending: Vec<String>,
}

/// A command to one node, delivered over its session in issue order.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CommandIssued {
    pub node_id: String,
    pub kind: String,
    /// A JSON object.
    pub args: serde_json::Value,
    pub deadline_at_ms: u64,
    /// Set on the commands a batch's release issues: what the node checks before it runs one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release: Option<bc_core::approval::BatchRelease>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CommandCancelled {
    pub node_id: String,
    pub reason: String,
}

/// `command.started`, `.succeeded`, `.failed`. From the node's journal they carry the entry
/// (`journal`); a command that passed its deadline undelivered is failed by the control plane,
/// without one.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CommandProgress {
    pub command_id: String,
    pub node_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal: Option<bc_core::agent::JournalOrigin>,
}

/// A command event as the command's rows fold it: the command, what its node reported (a start
/// or a finish), and `effect`, the command event type it counts as (a GPU report finishes its
/// command as `command.succeeded` or `.failed`).
pub(crate) struct CommandStep<'a> {
    pub command_id: String,
    pub progress: Option<CommandProgress>,
    pub effect: &'a str,
}

/// Folds one `command.*` event (on the command's stream) into the row `key`; any other type
/// leaves the row as it was.
pub(crate) fn apply(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    match env.event_type.as_str() {
        COMMAND_ISSUED | COMMAND_CANCELLED | COMMAND_STARTED | COMMAND_SUCCEEDED | COMMAND_FAILED => {
            let command_id = env.stream.split_once('/').map(|(_, id)| id.to_owned()).unwrap_or_default();
            let progress: Option<CommandProgress> =
                if matches!(env.event_type.as_str(), COMMAND_STARTED | COMMAND_SUCCEEDED | COMMAND_FAILED) {
                    Some(payload(event)?)
                } else {
                    None
                };
            apply_command(key, current, event, CommandStep { command_id, progress, effect: env.event_type.as_str() })
        }
        _ => Ok(current),
    }
}

/// What a node reports of one of its resources (`instance.observed`/`.apply_failed`,
/// `sandbox.observed`/`.apply_failed`), as the rows other than the resource's own fold it.
pub(crate) struct ResourceReport<'a> {
    /// What the report is, for an error: `an instance report`.
    pub what: &'a str,
    pub node_id: String,
    pub command_id: Option<String>,
    pub reason: Option<String>,
    pub journal: Option<bc_core::agent::JournalOrigin>,
    /// The answer to its command; `None` when it failed.
    pub result: Option<Value>,
    pub failed: bool,
}

/// Folds a node's [`ResourceReport`] into the node's row (its journal head) or into the command
/// it answers, which it finishes as `command.succeeded` or `.failed` would.
pub(crate) fn apply_report(
    key: &RowKey,
    current: Option<Value>,
    event: &StoredEvent,
    report: ResourceReport<'_>,
) -> Result<Option<Value>> {
    let ResourceReport { what, node_id, command_id, reason, journal, result, failed } = report;
    if key.kind == KIND_NODE {
        let journal = journal.ok_or_else(|| corrupt(event, format!("{what} without a journal entry touched its node")))?;
        let mut doc: NodeDoc = from_doc(event, current)?;
        advance_journal(&mut doc, &journal, event)?;
        return to_doc(&doc);
    }
    let command_id =
        command_id.ok_or_else(|| corrupt(event, format!("{} without a command touched a command", event.envelope.event_type)))?;
    let progress = CommandProgress { command_id: command_id.clone(), node_id, result, reason, journal };
    let effect = if failed { COMMAND_FAILED } else { COMMAND_SUCCEEDED };
    apply_command(key, current, event, CommandStep { command_id, progress: Some(progress), effect })
}

/// The rows a command event changes: the command, its live row, its node's queue and, for an
/// entry of the node's journal, the node's journal head (the node's version does not move: the
/// event is on the command's stream).
pub(crate) fn apply_command(
    key: &RowKey,
    current: Option<Value>,
    event: &StoredEvent,
    step: CommandStep<'_>,
) -> Result<Option<Value>> {
    let CommandStep { command_id, progress, effect } = step;
    match key.kind.as_str() {
        KIND_COMMAND | KIND_COMMAND_LIVE => command_doc(key, current, event, CommandStep { command_id, progress, effect }),
        KIND_NODE_COMMANDS => node_queue(key, current, event, command_id, effect),
        KIND_NODE => {
            let journal = progress
                .and_then(|p| p.journal)
                .ok_or_else(|| corrupt(event, "a command event without a journal entry touched its node".into()))?;
            let mut doc: NodeDoc = from_doc(event, current)?;
            advance_journal(&mut doc, &journal, event)?;
            to_doc(&doc)
        }
        _ => Ok(current),
    }
}

/// The command's document and its live row (removed once the command is finished).
fn command_doc(key: &RowKey, current: Option<Value>, event: &StoredEvent, step: CommandStep<'_>) -> Result<Option<Value>> {
    let CommandStep { command_id, progress, effect } = step;
    let env = &event.envelope;
    let issued = effect == COMMAND_ISSUED;
    if key.kind == KIND_COMMAND_LIVE && current.is_none() && !issued {
        return Ok(None);
    }
    let mut doc = if issued {
        let p: CommandIssued = payload(event)?;
        CommandDoc {
            tenant_id: env.tenant.to_string(),
            command_id,
            node_id: p.node_id,
            kind: p.kind,
            args: p.args,
            state: CommandState::Issued,
            reason: None,
            result: None,
            issued_by: env.actor.clone(),
            issued_at_ms: env.at_ms,
            deadline_at_ms: p.deadline_at_ms,
            started_at_ms: None,
            finished_at_ms: None,
            journal_seqs: Vec::new(),
            version: env.version,
            release: p.release,
        }
    } else {
        from_doc(event, current)?
    };
    if let Some(p) = &progress {
        if let Some(journal) = &p.journal {
            doc.journal_seqs.push(journal.seq);
        }
        // A report on a finished command (cancelled while it ran) is kept in the log
        // but does not reopen it.
        if !doc.state.is_finished() {
            match effect {
                COMMAND_STARTED => {
                    doc.state = CommandState::Started;
                    doc.started_at_ms = Some(env.at_ms);
                }
                COMMAND_SUCCEEDED => {
                    doc.state = CommandState::Succeeded;
                    doc.result = p.result.clone();
                    doc.finished_at_ms = Some(env.at_ms);
                }
                _ => {
                    doc.state = CommandState::Failed;
                    doc.reason = p.reason.clone();
                    doc.finished_at_ms = Some(env.at_ms);
                }
            }
        }
    } else if effect == COMMAND_CANCELLED && !doc.state.is_finished() {
        let p: CommandCancelled = payload(event)?;
        doc.state = CommandState::Cancelled;
        doc.reason = Some(p.reason);
        doc.finished_at_ms = Some(env.at_ms);
    }
    // A GPU report finishes its command from the reservation's stream: the command's own
    // version moves only with its own stream.
    if env.stream.starts_with(&format!("{KIND_COMMAND}/")) {
        doc.version = env.version;
    }
    if key.kind == KIND_COMMAND_LIVE && doc.state.is_finished() { Ok(None) } else { to_doc(&doc) }
}

/// The node's queue of unfinished commands: an issued command joins it, a finished one leaves.
fn node_queue(
    key: &RowKey,
    current: Option<Value>,
    event: &StoredEvent,
    command_id: String,
    effect: &str,
) -> Result<Option<Value>> {
    let env = &event.envelope;
    let issued = effect == COMMAND_ISSUED;
    let mut queue: NodeCommandsDoc = match current {
        Some(doc) => serde_json::from_value(doc).map_err(|e| Error::Internal(format!("projection document: {e}")))?,
        None => NodeCommandsDoc::default(),
    };
    if issued {
        // The bound is `commands.issue`'s; the control plane's own GPU commands (one or two
        // per placement, so bounded by the node's GPUs and the hold attempts) are never
        // refused here, or an expiry or a release would fail for a node that is away.
        let kind = canonical::to_json(&env.payload).get("kind").and_then(Value::as_str).map(str::to_owned);
        // `instances.*` checks the bound before it issues `instance.apply`; the reconciler's
        // applies again are bounded by the instances' attempts.
        let ours = kind.is_some_and(|k| k.starts_with("gpu.") || k == INSTANCE_APPLY);
        if !ours && queue.pending.len() >= COMMANDS_PENDING_PER_NODE_MAX {
            return Err(corrupt(event, format!("node {} has {COMMANDS_PENDING_PER_NODE_MAX} unfinished commands", key.id)));
        }
        queue.pending.push(command_id);
    } else if effect != COMMAND_STARTED {
        queue.pending.retain(|id| *id != command_id);
    }
    if queue.pending.is_empty() { Ok(None) } else { to_doc(&queue) }
}

/// The rows an event on the command's stream changes.
pub(crate) fn touches(event: &StoredEvent, id: &str, out: &mut Vec<RowKey>) {
    let tenant = event.envelope.tenant.to_string();
    let row = |kind: &str, id: &str| RowKey { tenant: tenant.clone(), kind: kind.to_owned(), id: id.to_owned() };
    out.push(row(KIND_COMMAND, id));
    out.push(row(KIND_COMMAND_LIVE, id));
    // Every command event names its node: its queue changes, and an entry from its
    // journal moves the node's journal head.
    if let Some(node) = canonical::to_json(&event.envelope.payload).get("nodeId").and_then(Value::as_str) {
        out.push(row(KIND_NODE_COMMANDS, node));
        if event.envelope.payload_has(bc_core::agent::JOURNAL_PAYLOAD_KEY) {
            out.push(row(KIND_NODE, node));
        }
    }
}

/// The rows a node's GPU or instance report (on the reservation's or the instance's stream)
/// changes beside its stream's: it finishes its command, and moves its node's journal head.
pub(crate) fn touches_report(event: &StoredEvent, out: &mut Vec<RowKey>) {
    // On the reservation's (or the instance's) stream (its rows below), and it finishes its command: the
    // command's rows, its node's queue and the node's journal head.
    let tenant = event.envelope.tenant.to_string();
    let row = |kind: &str, id: &str| RowKey { tenant: tenant.clone(), kind: kind.to_owned(), id: id.to_owned() };
    let report = canonical::to_json(&event.envelope.payload);
    let node = report.get("nodeId").and_then(Value::as_str);
    if let (Some(command), Some(node)) = (report.get("commandId").and_then(Value::as_str), node) {
        out.push(row(KIND_COMMAND, command));
        out.push(row(KIND_COMMAND_LIVE, command));
        out.push(row(KIND_NODE_COMMANDS, node));
    }
    // Any entry of a node's journal moves the node's journal head (an instance report
    // may answer no command: a change the node saw by itself).
    if let Some(node) = node
        && event.envelope.payload_has(bc_core::agent::JOURNAL_PAYLOAD_KEY)
    {
        out.push(row(KIND_NODE, node));
    }
}
