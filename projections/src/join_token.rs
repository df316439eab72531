//! Join tokens (`join_token/jt_…`): the document, the payloads of `join_token.*`, and their fold.
//!
//! A token lets up to `usesMax` machines join one pool until it expires or is revoked. Its
//! document never holds the secret or the secret's hash (those are in the secret store). A use
//! is folded only while one is left: the join decision reads the token at its version, so the
//! fold refusing an extra use is a broken log, never a race.

use bc_core::Result;
use bc_core::event::StoredEvent;
use bc_core::store::RowKey;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{NoFields, corrupt, create, from_doc, payload, to_doc};

pub const JOIN_TOKEN_CREATED: &str = "join_token.created";
pub const JOIN_TOKEN_USED: &str = "join_token.used";
pub const JOIN_TOKEN_REVOKED: &str = "join_token.revoked";

/// A join token's document (never its secret or the secret's hash).
pub const KIND_JOIN_TOKEN: &str = "join_token";

/// A join token's document: what `joinTokens.list` shows.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct JoinTokenDoc {
    pub tenant_id: String,
    pub join_token_id: String,
    pub pool_id: String,
    pub description: String,
    pub expires_at_ms: u64,
    pub uses_max: u32,
    pub uses: u32,
    /// The one node a machine may join as with it (a bare-metal deploy's token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    /// The nodes that joined with it, oldest first.
    pub node_ids: Vec<String>,
    pub revoked: bool,
    pub version: u64,
    pub created_at_ms: u64,
}

/// A join token: who may join, into which pool, until when, how often. The secret's hash is
/// not here: it lives in the secret store, so the log and its receivers never carry it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JoinTokenCreated {
    pub pool_id: String,
    pub description: String,
    pub expires_at_ms: u64,
    pub uses_max: u32,
    /// The one node a machine may join as with it (a bare-metal deploy's token: the installed
    /// system joins as the enrolled machine's node, `bcd join --node-id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
}

/// A join spent one use of the token (in the same append as `node.joined`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JoinTokenUsed {
    pub node_id: String,
}

pub type JoinTokenRevoked = NoFields;

/// Folds one `join_token.*` event into the row `key`; any other type leaves the row as it was.
pub(crate) fn apply(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    match env.event_type.as_str() {
        JOIN_TOKEN_CREATED => create(event, |p: JoinTokenCreated, env| JoinTokenDoc {
            tenant_id: env.tenant.to_string(),
            join_token_id: key.id.clone(),
            pool_id: p.pool_id,
            description: p.description,
            expires_at_ms: p.expires_at_ms,
            uses_max: p.uses_max,
            uses: 0,
            node_id: p.node_id,
            node_ids: Vec::new(),
            revoked: false,
            version: env.version,
            created_at_ms: env.at_ms,
        }),
        JOIN_TOKEN_USED | JOIN_TOKEN_REVOKED => {
            let mut doc: JoinTokenDoc = from_doc(event, current)?;
            if env.event_type == JOIN_TOKEN_USED {
                let p: JoinTokenUsed = payload(event)?;
                if doc.uses >= doc.uses_max || doc.revoked {
                    // The join decision reads the token at its version; never spend more.
                    return Err(corrupt(event, format!("join token {} has no use left", key.id)));
                }
                doc.uses += 1;
                doc.node_ids.push(p.node_id);
            } else {
                doc.revoked = true;
            }
            doc.version = env.version;
            to_doc(&doc)
        }
        _ => Ok(current),
    }
}
