//! Writing an export: one tenant's chain, read from the store page by page and written as it is
//! read (memory bounded by a page of `READ_ROWS_MAX` rows, whatever the log's size).
//!
//! The rows are written as stored, after the order-free checks of `EventRow::check` (hash,
//! deterministic encoding, columns against the envelope): an export never carries a row the
//! store itself would call corrupt. Signatures are the reader's to check, against its pin.

use std::io::Write;

use bc_core::event::{GENESIS_PREV, SIGNED_SEQ_INTERVAL};
use bc_core::id::TenantId;
use bc_core::store::{EventStore, READ_ROWS_MAX};
use bc_core::{Error, Result};

use crate::format::{Header, Record, encode_item};

/// What was written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exported {
    pub from_seq: u64,
    pub to_seq: u64,
    pub events: u64,
    pub bytes: u64,
    pub key_ids: Vec<String>,
    pub rotations: u64,
}

/// Writes `tenant`'s events `from_seq ..= to_seq` (default: to the chain head as read when the
/// export starts; a `to_seq` whose event carries no signature of its own is moved on to the next
/// that does, so the file's last records verify) to `out` as the export format;
/// `progress(written, total)` after each page.
/// `deployment` names the log's keys in the rotations' checkpoints.
pub async fn export(
    store: &dyn EventStore,
    tenant: TenantId,
    from_seq: u64,
    to_seq: Option<u64>,
    deployment: &str,
    out: &mut dyn Write,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Exported> {
    let head = store
        .heads()
        .await?
        .into_iter()
        .find(|(t, _)| *t == tenant)
        .map(|(_, head)| head)
        .ok_or_else(|| Error::not_found(format!("any event of tenant {tenant} in this log")))?;
    if from_seq == 0 || from_seq > head.seq {
        return Err(Error::invalid(format!("--from {from_seq} is outside the chain, seq 1 to {}", head.seq)));
    }
    let to_seq = to_seq.unwrap_or(head.seq).min(head.seq);
    if to_seq < from_seq {
        return Err(Error::invalid(format!("--to {to_seq} is before --from {from_seq}")));
    }
    // A file must end on a signed event for its last records to verify: on to the next one.
    let to_seq = signed_end(store, tenant, to_seq).await?;
    let prev_hash = if from_seq == 1 { GENESIS_PREV } else { stored_hash(store, tenant, from_seq - 1).await? };
    let last_hash = stored_hash(store, tenant, to_seq).await?;
    let mut keys = Vec::new();
    for (key_id, public) in store.signing_keys().await? {
        let public = bc_core::keys::stored_public_key(&key_id, &public)?;
        keys.push((key_id, *public.as_bytes()));
    }
    if keys.len() > crate::format::KEYS_MAX {
        return Err(Error::Internal(format!("the log has more than {} keys", crate::format::KEYS_MAX)));
    }
    let vkeys = bc_core::audit::known_vkeys(store, deployment).await?;
    let rotations = bc_core::audit::rotation_proofs(store, &vkeys).await?;
    let header = Header {
        tenant: tenant.to_string(),
        from_seq,
        to_seq,
        prev_hash,
        last_hash,
        keys,
        rotations: bc_core::note::encode_rotations(&rotations),
    };
    let mut bytes = write_item(out, header.to_cbor())?;
    let total = to_seq - from_seq + 1;
    let (mut next, mut key_ids) = (from_seq, Vec::<String>::new());
    while next <= to_seq {
        let limit = u32::try_from((to_seq - next + 1).min(u64::from(READ_ROWS_MAX))).unwrap_or(READ_ROWS_MAX);
        let rows = store.read_chain_rows(tenant, next, limit).await?;
        if rows.is_empty() {
            return Err(corrupt(tenant, next, "event missing: the chain ends before its head".into()));
        }
        for row in rows {
            if row.seq != next {
                return Err(corrupt(tenant, next, format!("event missing: the next stored event is seq {}", row.seq)));
            }
            let prev = row.check().map_err(|what| corrupt(tenant, row.seq, what))?.prev;
            if !row.key_id.is_empty() && !key_ids.contains(&row.key_id) {
                key_ids.push(row.key_id.clone());
            }
            let record = Record {
                seq: row.seq,
                prev: prev.to_vec(),
                event: row.canonical,
                hash: row.hash,
                sig: row.sig,
                key_id: row.key_id,
                commit: row.commit,
                index: u64::from(row.index),
            };
            bytes += write_item(out, record.to_cbor())?;
            next += 1;
        }
        progress(next - from_seq, total);
    }
    Ok(Exported { from_seq, to_seq, events: total, bytes, key_ids, rotations: rotations.len() as u64 })
}

/// The first seq from `seq` on whose event carries a signature of its own (at most
/// `SIGNED_SEQ_INTERVAL − 1` further; the chain head is always signed).
async fn signed_end(store: &dyn EventStore, tenant: TenantId, seq: u64) -> Result<u64> {
    let rows = store.read_chain_rows(tenant, seq, SIGNED_SEQ_INTERVAL as u32).await?;
    rows.iter().find(|r| !r.sig.is_empty()).map(|r| r.seq).ok_or_else(|| {
        corrupt(tenant, seq, format!("no event from seq {seq} to {} carries a signature", seq + SIGNED_SEQ_INTERVAL - 1))
    })
}

async fn stored_hash(store: &dyn EventStore, tenant: TenantId, seq: u64) -> Result<[u8; 32]> {
    let row = store.read_chain_rows(tenant, seq, 1).await?.into_iter().next();
    match row {
        Some(row) if row.seq == seq => {
            <[u8; 32]>::try_from(row.hash.as_slice()).map_err(|_| corrupt(tenant, seq, "stored hash is not 32 bytes".into()))
        }
        _ => Err(corrupt(tenant, seq, "event missing".into())),
    }
}

fn corrupt(tenant: TenantId, seq: u64, what: String) -> Error {
    Error::Corrupt { tenant: tenant.to_string(), seq, what }
}

fn write_item(out: &mut dyn Write, value: ciborium::Value) -> Result<u64> {
    let bytes = encode_item(value)?;
    out.write_all(&bytes).map_err(|e| Error::Internal(format!("writing the export: {e}")))?;
    Ok(bytes.len() as u64)
}
