//! The [`Call`]: what a handler knows about the request it serves, and the one way it appends
//! and reads rows.
//!
//! Every append a handler makes goes through [`Call::submit`], which stamps it with the call's
//! idempotency key (in the `request:` namespace, apart from the server's own keys), request id
//! and body fingerprint, and remembers the projection rows the commit wrote, so that
//! [`Call::row`] answers with the row as the append left it instead of reading it back.
//!
//! **Idempotency keys.** A client's key (`Idempotency-Key`, printable ASCII) is never stored as
//! sent: on the calling tenant's own chain it is [`client_key`] (`request:KEY`); a reservation
//! held for the caller on a pool owner's chain keeps it as [`held_key`] (`held:TENANT:KEY`, the
//! caller's tenant, which authentication fixes, and which holds no `:`). The server's own keys
//! (`checkpoint:…`, `journal:…`, `secret_resolved:…`, …) take no client text first. So no key a
//! client sends lands in another namespace, or in another tenant's part of `held:`: the
//! invariant `client_keys_never_reach_another_namespace` holds.

use bc_core::id::TenantId;
use bc_core::store::{AppendRequest, AppendResult, ExpectedVersion, NewEvent, PreReadQuery, Row, RowKey};
use bc_core::{Error, Result};
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::body::parse_id;
use crate::AppState;
use crate::auth::Principal;

/// Everything a handler needs about the call.
pub struct Call<'a> {
    pub state: &'a AppState,
    pub principal: Option<Principal>,
    pub action: &'static str,
    pub idempotency_key: Option<String>,
    /// SHA-256 of the method name and the request body, for idempotent retries.
    pub fingerprint: [u8; 32],
    pub request_id: String,
    /// The projection rows this call's appends touched, as their commits left them: what
    /// [`Call::row`] answers for those rows instead of reading them back.
    pub appended: std::sync::Mutex<Vec<(RowKey, Option<Value>)>>,
}

impl Call<'_> {
    /// Who appends: the calling key.
    pub fn actor(&self) -> String {
        self.principal.as_ref().map(|p| format!("apikey:{}", p.key_id)).unwrap_or_else(|| "system".into())
    }

    pub fn principal(&self) -> &Principal {
        self.principal.as_ref().expect("authenticated methods have a principal")
    }

    /// The tenant the call acts in (the key's own unless `tenantId` says otherwise), authorized.
    pub async fn tenant(&self, requested: &Option<String>) -> Result<TenantId> {
        let requested = requested.as_deref().map(|t| parse_id("tenantId", t)).transpose()?;
        let principal = self.principal();
        let tenant = requested.unwrap_or(principal.tenant);
        self.state.authorize_tenant(principal, self.action, tenant).await?;
        Ok(tenant)
    }

    /// Appends one event to `stream` on behalf of this call.
    pub async fn append(
        &self,
        tenant: TenantId,
        stream: String,
        expected: ExpectedVersion,
        event_type: &str,
        payload: ciborium::Value,
    ) -> Result<AppendResult> {
        self.append_guarded(tenant, stream, expected, event_type, payload, vec![]).await
    }

    /// Appends one event to `stream`, only while the `guards` streams are at their versions.
    pub async fn append_guarded(
        &self,
        tenant: TenantId,
        stream: String,
        expected: ExpectedVersion,
        event_type: &str,
        payload: ciborium::Value,
        guards: Vec<(String, ExpectedVersion)>,
    ) -> Result<AppendResult> {
        let mut request = self.request(tenant, stream, expected, vec![NewEvent::new(event_type, payload)]);
        request.guards = guards;
        self.submit(request).await
    }

    /// Appends `request` and remembers the rows its commit left, so that a handler answering
    /// with a row its append just wrote does not read it back ([`Call::row`]). They move into
    /// the call: the result handed back has none.
    pub async fn submit(&self, request: AppendRequest) -> Result<AppendResult> {
        let mut result = self.state.log.append(request).await?;
        let mut appended = self.appended.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for (key, doc) in std::mem::take(&mut result.rows) {
            match appended.iter_mut().find(|(k, _)| *k == key) {
                Some(slot) => slot.1 = doc,
                None => appended.push((key, doc)),
            }
        }
        Ok(result)
    }

    /// An append on behalf of this call: its key, its request id, its fingerprint.
    pub fn request(&self, tenant: TenantId, stream: String, expected: ExpectedVersion, events: Vec<NewEvent>) -> AppendRequest {
        let mut request = AppendRequest::new(tenant, stream, expected, self.actor(), events);
        // Clients' keys live in their own namespace, apart from the server's own
        // (`checkpoint:…`), so a client cannot pre-empt them.
        request.idempotency_key = self.idempotency_key.as_deref().map(client_key);
        request.correlation = Some(self.request_id.clone());
        request.fingerprint = Some(self.fingerprint);
        request
    }

    /// The append a decision asked for (`bc_projections::decide::Append`: its events, stream,
    /// expected version and guards), on behalf of this call.
    pub fn decided(&self, tenant: TenantId, append: bc_projections::decide::Append) -> AppendRequest {
        let mut request = self.request(tenant, append.stream, append.expected, append.events);
        request.guards = append.guards;
        request
    }

    /// Whether this call's idempotency key was used before in `tenant`: a retry, which the
    /// append answers from the log whatever the state says now. A check that the first
    /// request's own effect now fails (its name is taken, by itself) is skipped for a retry.
    pub async fn is_retry(&self, tenant: TenantId) -> Result<bool> {
        let Some(key) = &self.idempotency_key else { return Ok(false) };
        let query = PreReadQuery { idempotency_keys: vec![(tenant, client_key(key))], ..Default::default() };
        Ok(!self.state.store.preread(&query).await?.idempotency.is_empty())
    }

    /// This call's key for a reservation held for `holder` on another tenant's chain
    /// ([`held_key`]); `None` without a key.
    pub fn held_key(&self, holder: TenantId) -> Option<String> {
        self.idempotency_key.as_deref().map(|k| held_key(holder, k))
    }

    /// Now, from the deployment's clock.
    pub fn now_ms(&self) -> u64 {
        self.state.log.clock.now_ms()
    }

    /// A fresh ULID for a new entity's id, from the deployment's id source (seeded in tests
    /// and the simulator, so the same inputs give the same ids).
    pub fn ulid(&self) -> ulid::Ulid {
        self.state.log.ids.ulid()
    }

    /// The stored document of `kind/id`, or `NOT_FOUND` naming `what`: as this call's own
    /// append left it when one touched it, else read.
    pub async fn row<T: DeserializeOwned>(&self, tenant: TenantId, kind: &str, id: &str, what: &str) -> Result<T> {
        let not_found = || Error::not_found(format!("{what} {id}"));
        let key = RowKey { tenant: tenant.to_string(), kind: kind.to_owned(), id: id.to_owned() };
        let remembered: Option<Result<T>> = {
            let appended = self.appended.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            appended.iter().find(|(k, _)| *k == key).map(|(_, doc)| match doc {
                Some(doc) => T::deserialize(doc).map_err(|e| Error::Internal(format!("projection document {kind}/{id}: {e}"))),
                None => Err(not_found()),
            })
        };
        match remembered {
            Some(answer) => answer,
            None => doc(self.state.store.row_get(&key.tenant, kind, id).await?.ok_or_else(not_found)?),
        }
    }
}

/// The version an append expects: the version the handler read and checked. A stated
/// `ifVersion` must be that same version, else `CONFLICT` before anything is appended: a request
/// checked against one version and appended at another could land on a deleted webhook or an
/// archived pool, which the projection fold then refuses inside the commit.
pub fn expected_version(if_version: Option<u64>, read: u64, stream: &str) -> Result<ExpectedVersion> {
    match if_version {
        Some(stated) if stated != read => {
            Err(Error::Conflict { stream: stream.to_owned(), expected: ExpectedVersion::Exact(stated).to_string(), actual: read })
        }
        _ => Ok(ExpectedVersion::Exact(read)),
    }
}

/// An `ifVersion` within what the schema states (`VersionNumber`: 0 to `i64::MAX`), checked
/// first by a method whose retry skips the version check itself (the first attempt moved the
/// version on): a larger one is refused as the schema refuses it.
pub fn check_if_version(if_version: Option<u64>) -> Result<()> {
    match if_version {
        Some(v) if v > i64::MAX as u64 => Err(Error::invalid(format!("ifVersion must be 0 to {}, not {v}", i64::MAX))),
        _ => Ok(()),
    }
}

/// The id in a stream name (`pool/pool_…` → `pool_…`).
pub fn stream_id(stream: &str) -> &str {
    stream.split_once('/').map(|(_, id)| id).unwrap_or_default()
}

/// The stored form of a client's idempotency key on its own chain.
pub fn client_key(key: &str) -> String {
    format!("request:{key}")
}

/// The stored form of `holder`'s idempotency key on the chain of a pool's owner, where its held
/// reservation lives: apart from the owner's own keys and from every other holder's.
pub fn held_key(holder: TenantId, key: &str) -> String {
    format!("held:{holder}:{key}")
}

pub fn doc<T: DeserializeOwned>(row: Row) -> Result<T> {
    serde_json::from_value(row.doc).map_err(|e| Error::Internal(format!("projection document: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No key a client can send (any printable ASCII, even one spelled like a stored key of
    /// another namespace) is stored as a key of another namespace: the owner's client writing
    /// `held:B:k` does not take B's `k`, and B's held key is not C's.
    #[test]
    fn client_keys_never_reach_another_namespace() {
        let b: TenantId = "ten_01hzz00000000000000000000b".parse().unwrap();
        let c: TenantId = "ten_01hzz00000000000000000000c".parse().unwrap();
        let sent = ["k", "held:ten_01hzz00000000000000000000b:k", "request:k", ":k", "ten_01hzz00000000000000000000b:k"];
        let mut stored = std::collections::BTreeMap::new();
        for key in sent {
            for (form, stored_key) in
                [("own".to_owned(), client_key(key)), (format!("{b}"), held_key(b, key)), (format!("{c}"), held_key(c, key))]
            {
                if let Some(other) = stored.insert(stored_key.clone(), (form.clone(), key)) {
                    panic!("{stored_key:?} stored for {:?} and for {:?}", other, (form, key));
                }
                assert!(!stored_key.starts_with("checkpoint:") && !stored_key.starts_with("journal:"));
            }
        }
        assert_eq!(stored.len(), sent.len() * 3);
        // Only the holder's own authenticated tenant is ever in the held namespace's second part.
        assert!(held_key(b, "x").starts_with(&format!("held:{b}:")));
        assert!(!client_key("held:x").starts_with("held:"));
    }

    /// A stated `ifVersion` other than the version read is `CONFLICT`;
    /// the append always expects the version read.
    #[test]
    fn expected_version_is_the_version_read() {
        assert_eq!(expected_version(None, 3, "pool/p").unwrap(), ExpectedVersion::Exact(3));
        assert_eq!(expected_version(Some(3), 3, "pool/p").unwrap(), ExpectedVersion::Exact(3));
        for stated in [2, 4] {
            match expected_version(Some(stated), 3, "pool/p") {
                Err(Error::Conflict { stream, actual: 3, .. }) => assert_eq!(stream, "pool/p"),
                other => panic!("ifVersion {stated} at version 3: {other:?}"),
            }
        }
    }
}
