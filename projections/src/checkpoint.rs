//! Checkpoints' rows (`checkpoint/…` by tree size): the fold of `checkpoint.sealed` and
//! `checkpoint.cosigned`, whose payloads and whose sealing live in `bc_core::audit`.
//!
//! One row per checkpoint, keyed by its size, not one per stream: a cosignature adds its line to
//! the row of the checkpoint it signs, once, and at most [`bc_core::witness::WITNESSES_MAX`]
//! lines; a cosignature of a checkpoint never sealed is a broken log.

use bc_core::audit;
use bc_core::event::StoredEvent;
use bc_core::store::RowKey;
use bc_core::{Error, Result};
use serde_json::Value;

/// Whether an event is a checkpoint's (its rows are by size, not by stream).
pub(crate) fn is_checkpoint(event: &StoredEvent) -> bool {
    event.envelope.event_type == audit::CHECKPOINT_SEALED || event.envelope.event_type == audit::CHECKPOINT_COSIGNED
}

/// The checkpoint's row, by the size it seals or cosigns.
pub(crate) fn touches(event: &StoredEvent, out: &mut Vec<RowKey>) {
    let size = audit::parse_checkpoint_payload(&event.envelope.payload)
        .map(|(size, _)| size)
        .or_else(|| audit::parse_cosigned_payload(&event.envelope.payload).map(|(size, _, _)| size));
    if let Some(size) = size {
        out.push(RowKey {
            tenant: event.envelope.tenant.to_string(),
            kind: audit::KIND_CHECKPOINT.to_owned(),
            id: audit::checkpoint_row_id(size),
        });
    }
}

/// Folds one `checkpoint.*` event into its checkpoint's row; any other type leaves the row as
/// it was.
pub(crate) fn apply(current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    let tenant_id = env.tenant.to_string();
    match env.event_type.as_str() {
        audit::CHECKPOINT_SEALED => {
            let (size, note) = audit::parse_checkpoint_payload(&env.payload).ok_or_else(|| Error::Corrupt {
                tenant: tenant_id.clone(),
                seq: env.seq,
                what: "checkpoint.sealed payload does not parse".into(),
            })?;
            Ok(Some(serde_json::json!({ "treeSize": size, "note": note, "seq": env.seq, "sealedAtMs": env.at_ms })))
        }
        audit::CHECKPOINT_COSIGNED => {
            let (_, _, line) = audit::parse_cosigned_payload(&env.payload).ok_or_else(|| Error::Corrupt {
                tenant: tenant_id.clone(),
                seq: env.seq,
                what: "checkpoint.cosigned payload does not parse".into(),
            })?;
            let mut doc = current.ok_or_else(|| Error::Corrupt {
                tenant: tenant_id.clone(),
                seq: env.seq,
                what: "a cosignature of a checkpoint that was never sealed".into(),
            })?;
            let lines = doc["cosignatures"].as_array().cloned().unwrap_or_default();
            if !lines.iter().any(|l| l.as_str() == Some(line.as_str())) && lines.len() < bc_core::witness::WITNESSES_MAX {
                let mut lines = lines;
                lines.push(serde_json::Value::String(line));
                doc["cosignatures"] = serde_json::Value::Array(lines);
            }
            Ok(Some(doc))
        }
        _ => Ok(current),
    }
}
