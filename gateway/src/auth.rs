//! API keys: a token is `KEY_ID.SECRET`; the server stores only SHA-256 of the secret, in the
//! secret store (`bc_projections::api_key_secret_id`), never in the log, so neither events nor
//! deliveries carry it and a rebuild of the projections still authenticates every key. It finds
//! the key's row by the key id the token carries.

use base64::Engine;
use bc_core::id::{ApiKeyId, TenantId};
use bc_core::{Error, Result};
use bc_projections::{ApiKeyDoc, KIND_API_KEY};
use sha2::{Digest, Sha256};

use crate::api::validate::string_schema;

/// Longest `Authorization` header accepted.
pub const TOKEN_BYTES_MAX: usize = 256;
/// Random bytes in a token's secret.
pub const SECRET_BYTES: usize = 32;

/// Every action the API decides on. `*` in a key grants all; `compute:pools:*` all of a group.
pub const ACTIONS: &[&str] = &[
    "compute:tenants:admin",
    "compute:apikeys:admin",
    "compute:pools:read",
    "compute:pools:write",
    "compute:pools:admin",
    "compute:nodes:read",
    "compute:nodes:write",
    "compute:nodes:console",
    "compute:nodes:ssh-root",
    "compute:events:read",
    "compute:capacity:read",
    "compute:reservations:read",
    "compute:reservations:write",
    "compute:quotas:read",
    "compute:quotas:admin",
    "compute:webhooks:read",
    "compute:webhooks:write",
    "compute:secrets:read",
    "compute:secrets:write",
    "compute:sites:read",
    "compute:sites:write",
    "compute:projects:read",
    "compute:projects:write",
    "compute:jointokens:admin",
    "compute:commands:read",
    "compute:commands:write",
    "compute:flavors:read",
    "compute:flavors:write",
    "compute:images:read",
    "compute:images:write",
    "compute:instances:read",
    "compute:instances:write",
    "compute:instances:exec",
    "compute:sandboxes:read",
    "compute:sandboxes:write",
    "compute:sandboxes:manage",
    "compute:sandboxes:exec",
    "compute:metal:read",
    "compute:metal:write",
    "compute:releases:read",
    "compute:releases:write",
    "compute:rollouts:read",
    "compute:rollouts:write",
    "compute:usage:read",
    "compute:usage:admin",
    "compute:batches:read",
    "compute:batches:create",
    "compute:batches:approve",
    "compute:approvers:admin",
    "compute:fleet:admin",
];

/// Most actions one key grants.
pub const ACTIONS_PER_KEY_MAX: usize = 64;

/// Every action a key may be granted: `*`, a group wildcard (`compute:pools:*`) or an action.
pub fn grantable_actions() -> Vec<String> {
    let mut all = vec!["*".to_owned()];
    for action in ACTIONS {
        // Every prefix ending at a `:` is a wildcard: `compute:*`, `compute:pools:*`.
        for (i, _) in action.match_indices(':') {
            let wildcard = format!("{}:*", &action[..i]);
            if !all.contains(&wildcard) {
                all.push(wildcard);
            }
        }
    }
    all.extend(ACTIONS.iter().map(|a| (*a).to_owned()));
    all
}

string_schema!(
    /// The schema of a key's actions: 1 to `ACTIONS_PER_KEY_MAX` of [`grantable_actions`].
    ActionList as "ActionList",
    |_| {
            schemars::json_schema!({
                "type": "array",
                "minItems": 1,
                "maxItems": ACTIONS_PER_KEY_MAX,
                "items": { "type": "string", "enum": grantable_actions() },
            })
    }
);

/// Who is calling.
#[derive(Clone, Debug)]
pub struct Principal {
    pub tenant: TenantId,
    pub key_id: String,
    pub actions: Vec<String>,
}

impl Principal {
    pub fn is_root(&self) -> bool {
        self.tenant == TenantId::ROOT
    }

    pub fn allows(&self, action: &str) -> bool {
        self.actions.iter().any(|granted| {
            granted == "*"
                || granted == action
                || granted.strip_suffix('*').is_some_and(|prefix| prefix.ends_with(':') && action.starts_with(prefix))
        })
    }

    /// Checks `action` on `tenant`: a key acts in its own tenant; a key of the root tenant (an
    /// operator's) acts in every tenant, and there too only with the actions it holds: a root
    /// key granted `compute:events:read` alone reads every tenant's events and changes nothing.
    /// A key meant for one tenant is made in that tenant.
    pub fn authorize(&self, action: &str, tenant: TenantId) -> Result<()> {
        if tenant != self.tenant && !self.is_root() {
            return Err(Error::AccessDenied(format!("this key belongs to tenant {} and cannot act in {tenant}", self.tenant)));
        }
        if !self.allows(action) {
            return Err(Error::AccessDenied(format!("this key does not grant {action}")));
        }
        Ok(())
    }
}

pub fn secret_sha256(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

/// A fresh token for `key_id`, and the hash to store.
pub fn new_token(key_id: ApiKeyId) -> (String, String) {
    let secret = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(rand::random::<[u8; SECRET_BYTES]>());
    let hash = secret_sha256(&secret);
    (format!("{key_id}.{secret}"), hash)
}

/// Validates every action name a key is created with.
pub fn validate_actions(actions: &[String]) -> Result<()> {
    if actions.is_empty() || actions.len() > ACTIONS_PER_KEY_MAX {
        return Err(Error::invalid(format!("a key grants 1 to {ACTIONS_PER_KEY_MAX} actions")));
    }
    for action in actions {
        let known = action == "*"
            || ACTIONS.contains(&action.as_str())
            || action.strip_suffix(":*").is_some_and(|group| ACTIONS.iter().any(|a| a.starts_with(&format!("{group}:"))));
        if !known {
            return Err(Error::InvalidArgument {
                message: format!("unknown action {:?}", bc_core::id::truncate(action, 60)),
                hint: Some(format!("actions are *, GROUP:* or one of {}", ACTIONS.join(", "))),
            });
        }
    }
    Ok(())
}

/// A key can only grant what its creator holds: `*` only from a `*` key, a group wildcard only
/// if the creator holds every action of the group.
pub fn check_grantable(creator: &Principal, actions: &[String]) -> Result<()> {
    for action in actions {
        let covered = if action == "*" {
            creator.actions.iter().any(|a| a == "*")
        } else if let Some(group) = action.strip_suffix('*') {
            ACTIONS.iter().filter(|a| a.starts_with(group)).all(|a| creator.allows(a))
        } else {
            creator.allows(action)
        };
        if !covered {
            return Err(Error::AccessDenied(format!("cannot grant {action}: the calling key does not hold it")));
        }
    }
    Ok(())
}

/// The key id and the secret an `Authorization: Bearer KEY_ID.SECRET` header carries.
fn parse_token(header: Option<&str>) -> Result<(ApiKeyId, &str)> {
    let header =
        header.ok_or_else(|| Error::Unauthenticated("missing Authorization header; send Authorization: Bearer TOKEN".into()))?;
    if header.len() > TOKEN_BYTES_MAX {
        return Err(Error::Unauthenticated("Authorization header too long".into()));
    }
    let token =
        header.strip_prefix("Bearer ").ok_or_else(|| Error::Unauthenticated("Authorization must be Bearer TOKEN".into()))?.trim();
    let (key_id, secret) = token.split_once('.').ok_or_else(invalid_token)?;
    let key_id: ApiKeyId = key_id.parse().map_err(|_| invalid_token())?;
    Ok((key_id, secret))
}

fn invalid_token() -> Error {
    Error::Unauthenticated("invalid or revoked token".into())
}

/// Resolves the `Authorization` header to a principal, reading the key as it is now.
pub async fn authenticate(store: &dyn bc_core::store::EventStore, header: Option<&str>) -> Result<Principal> {
    let (key_id, secret) = parse_token(header)?;
    check_key(store, &key_id, &secret_sha256(secret)).await
}

/// The principal of `key_id` if the key is live and its secret's hash is `presented`.
async fn check_key(store: &dyn bc_core::store::EventStore, key_id: &ApiKeyId, presented: &str) -> Result<Principal> {
    let row = store.row_find(KIND_API_KEY, &key_id.to_string()).await?.ok_or_else(invalid_token)?;
    let doc: ApiKeyDoc = serde_json::from_value(row.doc).map_err(|e| Error::Internal(format!("api key document: {e}")))?;
    if doc.revoked {
        return Err(invalid_token());
    }
    let tenant: TenantId = doc.tenant_id.parse()?;
    // Keys created before the hash left the log carry it in their document.
    let expected = if doc.secret_sha256.is_empty() {
        store.secret_get(tenant, &bc_projections::api_key_secret_id(&doc.key_id)).await?.ok_or_else(invalid_token)?
    } else {
        doc.secret_sha256
    };
    // Both sides are SHA-256 digests, so comparing them leaks nothing about the secret.
    if expected != presented {
        return Err(invalid_token());
    }
    Ok(Principal { tenant, key_id: doc.key_id, actions: doc.actions })
}

/// How long a key found live is taken from memory before it is read again: the longest a key
/// revoked through another process (another `serve` on the same database) still authenticates
/// here. A key revoked through this process is forgotten at once ([`KeyCache::forget`]), and a
/// watch checks its key again without the cache.
pub const KEY_CACHE_TTL: std::time::Duration = std::time::Duration::from_secs(1);
/// Most keys held; when full, the expired ones are dropped, and if none had, all of them.
pub const KEY_CACHE_KEYS_MAX: usize = 10_000;

/// The keys this process found live lately, with the hash of the secret they were presented
/// with, so a busy key is not read (its row, its sealed hash) on every request: under API
/// writes the two reads and the unsealing were 9 % of the server's instructions.
/// A failed check is never remembered.
#[derive(Default)]
pub struct KeyCache {
    keys: std::sync::Mutex<Keys>,
}

#[derive(Default)]
struct Keys {
    live: std::collections::HashMap<ApiKeyId, CachedKey>,
    /// Counts [`KeyCache::forget`]s: a check that read the key before a revocation and
    /// finishes after it must not put the key back.
    forgets: u64,
}

struct CachedKey {
    secret_sha256: String,
    principal: Principal,
    until: std::time::Instant,
}

impl KeyCache {
    /// [`authenticate`], from memory for a key found live within [`KEY_CACHE_TTL`] with the
    /// same secret.
    pub async fn authenticate(&self, store: &dyn bc_core::store::EventStore, header: Option<&str>) -> Result<Principal> {
        let (key_id, secret) = parse_token(header)?;
        let presented = secret_sha256(secret);
        let now = std::time::Instant::now();
        let forgets = {
            let keys = self.lock();
            if let Some(cached) = keys.live.get(&key_id)
                && cached.until > now
                && cached.secret_sha256 == presented
            {
                return Ok(cached.principal.clone());
            }
            keys.forgets
        };
        let principal = check_key(store, &key_id, &presented).await?;
        let mut keys = self.lock();
        if keys.forgets != forgets {
            return Ok(principal);
        }
        if keys.live.len() >= KEY_CACHE_KEYS_MAX {
            keys.live.retain(|_, cached| cached.until > now);
            if keys.live.len() >= KEY_CACHE_KEYS_MAX {
                keys.live.clear();
            }
        }
        let cached = CachedKey { secret_sha256: presented, principal: principal.clone(), until: now + KEY_CACHE_TTL };
        keys.live.insert(key_id, cached);
        Ok(principal)
    }

    /// Forgets `key_id` (revoked through this process).
    pub fn forget(&self, key_id: &ApiKeyId) {
        let mut keys = self.lock();
        keys.live.remove(key_id);
        keys.forgets += 1;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Keys> {
        self.keys.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards() {
        let p = Principal { tenant: TenantId::generate(), key_id: "k".into(), actions: vec!["compute:pools:*".into()] };
        assert!(p.allows("compute:pools:write"));
        assert!(!p.allows("compute:nodes:read"));
        assert!(p.authorize("compute:pools:read", TenantId::generate()).is_err(), "other tenant");
        assert!(validate_actions(&["compute:pools:*".into(), "*".into()]).is_ok());
        assert!(validate_actions(&["compute:bogus:read".into()]).is_err());
        assert!(validate_actions(&["compute:bogus:*".into()]).is_err());
        for action in grantable_actions() {
            assert!(validate_actions(std::slice::from_ref(&action)).is_ok(), "{action}");
        }
        // Regression (review): `compute:*` was accepted but missing from the schema's list.
        assert!(grantable_actions().contains(&"compute:*".to_owned()));
        // Regression: a key could grant more than its creator held.
        assert!(check_grantable(&p, &["compute:pools:read".into(), "compute:pools:*".into()]).is_ok());
        assert!(check_grantable(&p, &["*".into()]).is_err());
        assert!(check_grantable(&p, &["compute:nodes:read".into()]).is_err());
    }

    /// A root key acts in every tenant with the actions it holds, and with no other.
    #[test]
    fn a_root_key_acts_in_every_tenant_within_its_actions() {
        let root = Principal { tenant: TenantId::ROOT, key_id: "k".into(), actions: vec!["compute:events:read".into()] };
        let elsewhere = TenantId::generate();
        assert!(root.authorize("compute:events:read", elsewhere).is_ok());
        assert!(root.authorize("compute:pools:write", elsewhere).is_err());
        assert!(root.authorize("compute:pools:write", TenantId::ROOT).is_err());
    }
}
