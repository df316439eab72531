//! Sites (`sites.create`, `sites.update`, `sites.delete`): what each appends, or why not. Pure:
//! the gateway reads the tenant's sites and what names one, draws the new id, and appends what
//! these say.

use std::collections::BTreeMap;

use bc_core::id::SiteId;
use bc_core::store::{ExpectedVersion, NewEvent};
use bc_core::{Error, Result};

use super::Append;
use crate::events::{self as ev, to_cbor};
use crate::site::{KIND_SITE, SiteDoc};
use crate::stream_of;

/// Sites one tenant holds at most: a create reads them all (the name's uniqueness).
pub const SITES_PER_TENANT_MAX: usize = 256;
/// Most referrers a refused delete names.
pub const SITE_REFERRERS_SHOWN_MAX: usize = 10;

/// A stated `ifVersion` other than the one read is `CONFLICT`.
fn check_version(doc: &SiteDoc, if_version: Option<u64>) -> Result<()> {
    match if_version {
        Some(wanted) if wanted != doc.version => Err(Error::Conflict {
            stream: stream_of(KIND_SITE, &doc.site_id),
            expected: format!("version {wanted}"),
            actual: doc.version,
        }),
        _ => Ok(()),
    }
}

/// A name another site of the tenant than `except` holds is `ALREADY_EXISTS`.
fn check_name_free(existing: &[SiteDoc], name: &str, except: Option<&str>) -> Result<()> {
    match existing.iter().find(|s| s.name == name && Some(s.site_id.as_str()) != except) {
        Some(same) => Err(Error::AlreadyExists { what: format!("site {name:?} ({})", same.site_id) }),
        None => Ok(()),
    }
}

/// A new site `new_id` called `name` (free in the tenant, within its bound) in `region`.
pub fn site_create(
    existing: &[SiteDoc],
    new_id: SiteId,
    name: &str,
    region: &str,
    labels: BTreeMap<String, String>,
) -> Result<Append> {
    check_name_free(existing, name, None)?;
    if existing.len() >= SITES_PER_TENANT_MAX {
        return Err(Error::state(
            format!("a tenant has at most {SITES_PER_TENANT_MAX} sites"),
            "delete sites nothing names (sites delete)",
        ));
    }
    let payload = to_cbor(&ev::SiteCreated { name: name.to_owned(), region: region.to_owned(), labels })?;
    Ok(Append {
        stream: stream_of(KIND_SITE, &new_id),
        expected: ExpectedVersion::NoStream,
        guards: Vec::new(),
        events: vec![NewEvent::new(ev::SITE_CREATED, payload)],
    })
}

/// An update of `doc` (at `if_version` when given) to `change`: only the fields that differ,
/// a new name free in the tenant; `None` when nothing differs (nothing is appended).
pub fn site_update(
    existing: &[SiteDoc],
    doc: &SiteDoc,
    if_version: Option<u64>,
    change: ev::SiteUpdated,
) -> Result<Option<Append>> {
    check_version(doc, if_version)?;
    if let Some(name) = &change.name {
        check_name_free(existing, name, Some(&doc.site_id))?;
    }
    let changed =
        ev::SiteUpdated { name: change.name.filter(|n| *n != doc.name), labels: change.labels.filter(|l| *l != doc.labels) };
    if changed == ev::SiteUpdated::default() {
        return Ok(None);
    }
    Ok(Some(Append {
        stream: stream_of(KIND_SITE, &doc.site_id),
        expected: ExpectedVersion::Exact(doc.version),
        guards: Vec::new(),
        events: vec![NewEvent::new(ev::SITE_UPDATED, to_cbor(&changed)?)],
    }))
}

/// A delete of `doc` (at `if_version` when given), refused while anything names it
/// (`referrers`: `pool/pool_…`, …), naming them.
pub fn site_delete(doc: &SiteDoc, if_version: Option<u64>, referrers: &[String]) -> Result<Append> {
    check_version(doc, if_version)?;
    if !referrers.is_empty() {
        let mut shown: Vec<&str> = referrers.iter().take(SITE_REFERRERS_SHOWN_MAX).map(String::as_str).collect();
        if referrers.len() > shown.len() {
            shown.push("…");
        }
        return Err(Error::state(
            format!("site {:?} ({}) is named by {}", doc.name, doc.site_id, shown.join(", ")),
            "archive those pools and retire those machines first (a pool's or a machine's site does not change)",
        ));
    }
    Ok(Append {
        stream: stream_of(KIND_SITE, &doc.site_id),
        expected: ExpectedVersion::Exact(doc.version),
        guards: Vec::new(),
        events: vec![NewEvent::new(ev::SITE_DELETED, to_cbor(&ev::SiteDeleted {})?)],
    })
}

/// The site a machine enrolled into pool `pool_id` is at: the one asked for (`asked`, a live
/// site of the tenant, as the gateway read it), or its pool's (`pool_site`) when none is asked
/// for; `None` when neither names one. A site other than its pool's is `INVALID_STATE`: a pool's
/// site is where its machines are.
pub fn machine_site(pool_id: &str, pool_site: Option<&str>, asked: Option<&str>) -> Result<Option<String>> {
    match (pool_site, asked) {
        (Some(pool_site), Some(asked)) if pool_site != asked => Err(Error::state(
            format!("pool {pool_id} is at site {pool_site}: a machine of it is not at {asked}"),
            "name the pool's site, or none (the machine takes the pool's), or enroll it into a pool at that site",
        )),
        (pool_site, asked) => Ok(asked.or(pool_site).map(str::to_owned)),
    }
}

/// Whether `machine` holds its site against a delete: it names `site_id` and is not retired (a
/// retired machine is never offered or deployed again, as an archived pool takes no work).
pub fn machine_holds_site(machine: &crate::workflow::MetalDoc, site_id: &str) -> bool {
    !machine.flags.retired && machine.site_id.as_deref() == Some(site_id)
}

#[cfg(test)]
mod tests {
    use bc_core::ErrorCode;

    use super::*;

    fn doc(name: &str, n: usize) -> SiteDoc {
        SiteDoc {
            tenant_id: bc_core::id::TenantId::ROOT.to_string(),
            site_id: format!("site_{n}"),
            name: name.into(),
            region: "eu-west".into(),
            labels: BTreeMap::from([("rack".into(), "a".into())]),
            version: 4,
            created_at_ms: 0,
            updated_at_ms: 0,
        }
    }

    fn id() -> SiteId {
        SiteId::from_ulid(ulid::Ulid::from_parts(5, 5))
    }

    #[test]
    fn a_site_is_made_under_a_free_name_within_the_tenants_bound() {
        let made = site_create(&[], id(), "fra1", "eu-west", BTreeMap::new()).unwrap();
        assert_eq!(made.stream, format!("site/{}", id()));
        assert_eq!(made.expected, ExpectedVersion::NoStream);
        assert_eq!(made.event_types(), vec![ev::SITE_CREATED]);
        let held = [doc("fra1", 0)];
        let err = site_create(&held, id(), "fra1", "eu-west", BTreeMap::new()).unwrap_err();
        assert_eq!(err.code(), ErrorCode::AlreadyExists, "{err}");
        let full: Vec<SiteDoc> = (0..SITES_PER_TENANT_MAX).map(|n| doc(&format!("s{n}"), n)).collect();
        assert_eq!(site_create(&full, id(), "one-more", "eu", BTreeMap::new()).unwrap_err().code(), ErrorCode::InvalidState);
        assert!(site_create(&full[1..], id(), "one-more", "eu", BTreeMap::new()).is_ok());
    }

    #[test]
    fn an_update_appends_only_what_differs() {
        let sites = [doc("fra1", 0), doc("ams1", 1)];
        let same = ev::SiteUpdated { name: Some("fra1".into()), labels: Some(sites[0].labels.clone()) };
        assert_eq!(site_update(&sites, &sites[0], None, same).unwrap(), None, "nothing differs: nothing appended");
        let renamed = site_update(&sites, &sites[0], Some(4), ev::SiteUpdated { name: Some("fra2".into()), labels: None })
            .unwrap()
            .unwrap();
        assert_eq!(renamed.expected, ExpectedVersion::Exact(4));
        assert_eq!(renamed.event_types(), vec![ev::SITE_UPDATED]);
        let taken = ev::SiteUpdated { name: Some("ams1".into()), labels: None };
        assert_eq!(site_update(&sites, &sites[0], None, taken).unwrap_err().code(), ErrorCode::AlreadyExists);
        let stale = ev::SiteUpdated { name: Some("x".into()), labels: None };
        assert_eq!(site_update(&sites, &sites[0], Some(3), stale).unwrap_err().code(), ErrorCode::Conflict);
    }

    #[test]
    fn a_named_site_is_not_deleted_and_the_refusal_names_who_names_it() {
        let site = doc("fra1", 0);
        let append = site_delete(&site, None, &[]).unwrap();
        assert_eq!(append.event_types(), vec![ev::SITE_DELETED]);
        assert_eq!(append.expected, ExpectedVersion::Exact(site.version));
        let referrers: Vec<String> = (0..12).map(|n| format!("pool/pool_{n}")).collect();
        let err = site_delete(&site, None, &referrers).unwrap_err();
        assert_eq!(err.code(), ErrorCode::InvalidState);
        let text = err.to_string();
        assert!(text.contains("pool/pool_0") && text.contains("pool/pool_9") && text.contains('…'), "{text}");
        assert!(!text.contains("pool/pool_10"), "at most {SITE_REFERRERS_SHOWN_MAX} named: {text}");
        assert_eq!(site_delete(&site, Some(1), &[]).unwrap_err().code(), ErrorCode::Conflict);
        let err = site_delete(&site, None, &["metal/node_1".into()]).unwrap_err();
        assert!(err.to_string().contains("metal/node_1"), "a machine holds it too: {err}");
    }

    #[test]
    fn a_machine_is_at_its_pools_site_or_the_one_it_names() {
        assert_eq!(machine_site("pool_1", None, None).unwrap(), None);
        assert_eq!(machine_site("pool_1", None, Some("site_a")).unwrap().as_deref(), Some("site_a"));
        assert_eq!(machine_site("pool_1", Some("site_a"), None).unwrap().as_deref(), Some("site_a"), "its pool's");
        assert_eq!(machine_site("pool_1", Some("site_a"), Some("site_a")).unwrap().as_deref(), Some("site_a"));
        let err = machine_site("pool_1", Some("site_a"), Some("site_b")).unwrap_err();
        assert_eq!(err.code(), ErrorCode::InvalidState);
        assert!(err.to_string().contains("site_a") && err.to_string().contains("site_b"), "{err}");
    }

    #[test]
    fn a_retired_machine_no_longer_holds_its_site() {
        let mut machine: crate::workflow::MetalDoc = serde_json::from_value(serde_json::json!({
            "tenantId": "ten_1", "nodeId": "node_1", "poolId": "pool_1", "name": "m", "siteId": "site_a",
            "state": "manageable", "flags": { "retired": false },
            "bmc": { "address": "https://bmc", "username": "u", "tls": "insecure", "secretId": "bmc_x" },
            "stateEnteredAtMs": 0, "version": 1, "createdAtMs": 0, "updatedAtMs": 0,
        }))
        .unwrap();
        assert!(machine_holds_site(&machine, "site_a"));
        assert!(!machine_holds_site(&machine, "site_b"));
        machine.flags.retired = true;
        assert!(!machine_holds_site(&machine, "site_a"), "retired, it lets the site go");
        machine.flags.retired = false;
        machine.site_id = None;
        assert!(!machine_holds_site(&machine, "site_a"));
    }
}
