//! Secrets (`secrets.put`, `secrets.delete`): which stream a put writes and at which version,
//! and whether a delete may go. Pure: the gateway reads the tenant's secrets and what refers to
//! one, draws the id of a new secret, seals the value, and appends what these say.

use bc_core::id::SecretId;
use bc_core::store::{ExpectedVersion, NewEvent};
use bc_core::{Error, Result};

use super::Append;
use crate::events::{self as ev, to_cbor};
use crate::secret::{KIND_SECRET, SecretDoc, secret_value_id};
use crate::stream_of;

/// Secrets one tenant holds at most: a put reads them all (the name's uniqueness).
pub const SECRETS_PER_TENANT_MAX: usize = 500;
/// Largest value, in characters (a JSON string's, as the schema's `maxLength` counts them).
pub const SECRET_VALUE_CHARS_MAX: usize = 16 * 1024;
/// Most referrers a refused delete names.
pub const SECRET_REFERRERS_SHOWN_MAX: usize = 10;

/// What a put appends, and where the value goes.
#[derive(Debug, PartialEq)]
pub struct SecretPutPlan {
    pub secret_id: String,
    pub secret_version: u32,
    /// The secret store's id for this version's value (`sec_…/vN/…`), of this put alone.
    pub value_id: String,
    /// The value id of the version before the previous one: no longer read once this lands
    /// (the previous one is kept, so a delivery that read the document just before still
    /// finds its value).
    pub stale_value_id: Option<String>,
    pub append: Append,
}

/// A put of `name`: a new version of the tenant's secret of that name (at `if_version` when
/// given), or, if there is none, a new secret `new_id` at version 1 within the tenant's bound.
/// Its value goes to a row of its own, named with `nonce` (a fresh ULID): two puts racing to
/// the same version never write one row, so the loser's cleanup never takes the winner's value.
pub fn secret_put(
    existing: &[SecretDoc],
    name: &str,
    if_version: Option<u64>,
    new_id: SecretId,
    nonce: ulid::Ulid,
) -> Result<SecretPutPlan> {
    let found = existing.iter().find(|s| s.name == name);
    let (secret_id, secret_version, expected) = match found {
        Some(doc) => {
            if let Some(wanted) = if_version
                && wanted != doc.version
            {
                return Err(Error::Conflict {
                    stream: stream_of(KIND_SECRET, &doc.secret_id),
                    expected: format!("version {wanted}"),
                    actual: doc.version,
                });
            }
            let next = doc
                .secret_version
                .checked_add(1)
                .ok_or_else(|| Error::state("the secret has no next version", "delete it and put it again"))?;
            (doc.secret_id.clone(), next, ExpectedVersion::Exact(doc.version))
        }
        None => {
            if let Some(wanted) = if_version.filter(|v| *v != 0) {
                return Err(Error::Conflict {
                    stream: format!("secret {name:?}"),
                    expected: format!("version {wanted}"),
                    actual: 0,
                });
            }
            if existing.len() >= SECRETS_PER_TENANT_MAX {
                return Err(Error::state(
                    format!("a tenant has at most {SECRETS_PER_TENANT_MAX} secrets"),
                    "delete secrets nothing refers to (secrets delete)",
                ));
            }
            (new_id.to_string(), 1, ExpectedVersion::NoStream)
        }
    };
    let value_id = secret_value_id(&secret_id, secret_version, nonce);
    let payload = to_cbor(&ev::SecretPut { name: name.to_owned(), secret_version, value_id: value_id.clone() })?;
    Ok(SecretPutPlan {
        value_id,
        stale_value_id: found.and_then(|doc| doc.previous_value_id.clone()),
        append: Append {
            stream: stream_of(KIND_SECRET, &secret_id),
            expected,
            guards: Vec::new(),
            events: vec![NewEvent::new(ev::SECRET_PUT, payload)],
        },
        secret_id,
        secret_version,
    })
}

/// A delete of `doc` (at `if_version` when given), refused while anything refers to it
/// (`referrers`: `webhook/wh_…`, …), naming them.
pub fn secret_delete(doc: &SecretDoc, if_version: Option<u64>, referrers: &[String]) -> Result<Append> {
    let stream = stream_of(KIND_SECRET, &doc.secret_id);
    if let Some(wanted) = if_version
        && wanted != doc.version
    {
        return Err(Error::Conflict { stream, expected: format!("version {wanted}"), actual: doc.version });
    }
    if !referrers.is_empty() {
        let mut shown: Vec<&str> = referrers.iter().take(SECRET_REFERRERS_SHOWN_MAX).map(String::as_str).collect();
        let more = referrers.len() - shown.len();
        if more > 0 {
            shown.push("…");
        }
        return Err(Error::state(
            format!("secret {:?} ({}) is referred to by {}", doc.name, doc.reference(), shown.join(", ")),
            "point those at another secret (webhooks update --secret-ref) or delete them first",
        ));
    }
    Ok(Append {
        stream,
        expected: ExpectedVersion::Exact(doc.version),
        guards: Vec::new(),
        events: vec![NewEvent::new(ev::SECRET_DELETED, to_cbor(&ev::SecretDeleted {})?)],
    })
}

#[cfg(test)]
mod tests {
    use bc_core::ErrorCode;

    use super::*;

    fn doc(name: &str, n: usize, secret_version: u32) -> SecretDoc {
        SecretDoc {
            tenant_id: bc_core::id::TenantId::ROOT.to_string(),
            secret_id: format!("sec_{n}"),
            name: name.into(),
            secret_version,
            value_id: format!("sec_{n}/v{secret_version}/x"),
            previous_value_id: (secret_version > 1).then(|| format!("sec_{n}/v{}/x", secret_version - 1)),
            version: u64::from(secret_version) + 3,
            created_at_ms: 0,
            updated_at_ms: 0,
        }
    }

    fn id() -> SecretId {
        SecretId::from_ulid(ulid::Ulid::from_parts(5, 5))
    }

    fn nonce(n: u128) -> ulid::Ulid {
        ulid::Ulid::from_parts(0, n)
    }

    #[test]
    fn a_put_makes_a_secret_or_its_next_version_each_in_a_row_of_its_own() {
        let first = secret_put(&[], "db", None, id(), nonce(1)).unwrap();
        assert_eq!((first.secret_id.clone(), first.secret_version), (id().to_string(), 1));
        assert_eq!(first.value_id, format!("{}/v1/00000000000000000000000001", id()));
        assert_eq!(first.append.expected, ExpectedVersion::NoStream);
        assert_eq!(first.append.event_types(), vec![ev::SECRET_PUT]);
        assert_eq!(first.stale_value_id, None);
        let racing = secret_put(&[], "db", None, id(), nonce(2)).unwrap();
        assert_ne!(racing.value_id, first.value_id, "two puts of one version never share a row");

        let existing = vec![doc("db", 0, 3), doc("other", 1, 1)];
        let next = secret_put(&existing, "db", None, id(), nonce(1)).unwrap();
        assert_eq!((next.secret_id.as_str(), next.secret_version), ("sec_0", 4));
        assert_eq!(next.value_id, "sec_0/v4/00000000000000000000000001");
        assert_eq!(next.stale_value_id.as_deref(), Some("sec_0/v2/x"), "the previous version's value (v3) stays");
        assert_eq!(next.append.expected, ExpectedVersion::Exact(6));
        assert_eq!(secret_put(&existing, "db", Some(6), id(), nonce(1)).unwrap().secret_version, 4);
        assert_eq!(secret_put(&existing, "db", Some(5), id(), nonce(1)).unwrap_err().code(), ErrorCode::Conflict);
        assert_eq!(secret_put(&existing, "new", Some(2), id(), nonce(1)).unwrap_err().code(), ErrorCode::Conflict);
        assert_eq!(secret_put(&[doc("db", 0, 1)], "db", None, id(), nonce(1)).unwrap().stale_value_id, None);
    }

    #[test]
    fn a_tenant_holds_a_bounded_number_of_secrets() {
        let full: Vec<SecretDoc> = (0..SECRETS_PER_TENANT_MAX).map(|n| doc(&format!("s{n}"), n, 1)).collect();
        let err = secret_put(&full, "one-more", None, id(), nonce(1)).unwrap_err();
        assert_eq!(err.code(), ErrorCode::InvalidState, "{err}");
        assert!(secret_put(&full, "s7", None, id(), nonce(1)).is_ok(), "a new version of one held is no new secret");
    }

    #[test]
    fn a_referenced_secret_is_not_deleted_and_the_refusal_names_who_refers() {
        let secret = doc("hook", 0, 2);
        let append = secret_delete(&secret, None, &[]).unwrap();
        assert_eq!(append.event_types(), vec![ev::SECRET_DELETED]);
        assert_eq!(append.expected, ExpectedVersion::Exact(secret.version));
        let err = secret_delete(&secret, None, &["webhook/wh_a".into(), "webhook/wh_b".into()]).unwrap_err();
        assert_eq!(err.code(), ErrorCode::InvalidState);
        let text = err.to_string();
        assert!(text.contains("webhook/wh_a") && text.contains("webhook/wh_b") && text.contains("\"hook\""), "{text}");
        assert_eq!(secret_delete(&secret, Some(1), &[]).unwrap_err().code(), ErrorCode::Conflict);
    }
}
