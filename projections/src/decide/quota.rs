//! Quotas per resource (`quotas.set`'s `instances`, `vcpus`, `memoryMiB`, `sandboxes` beside
//! `gpus`): whether new work fits the tenant's quota in its pool, and what its append adds to
//! hold the bound across gateways. Pure: the gateway reads the quota and the tenant's live work
//! in the pool ([`ResourceUse`]); the decision that admits the work (an instance's create or
//! resize, a sandbox's create or claim) calls [`admit`].
//!
//! GPUs are counted by the reservations' own decision (`quota.charged`); these are the others.

use bc_core::store::{ExpectedVersion, NewEvent};
use bc_core::{Error, Result};

use super::Append;
use crate::events::{self as ev, to_cbor};
use crate::quota::{KIND_QUOTA, QuotaDoc};
use crate::stream_of;

/// The most instances, or sandboxes, a quota may allow (beyond any tenant's bounds).
pub const QUOTA_COUNT_MAX: u32 = 1_000_000;
/// The most vCPUs a quota may allow.
pub const QUOTA_VCPUS_MAX: u32 = 100_000_000;
/// The most memory a quota may allow, in MiB (1 EiB).
pub const QUOTA_MEMORY_MIB_MAX: u64 = 1 << 40;

/// What a tenant's live work in a pool holds, or what new work adds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ResourceUse {
    pub instances: u32,
    pub vcpus: u64,
    pub memory_mib: u64,
    pub sandboxes: u32,
}

impl ResourceUse {
    /// What one instance of `vcpus` and `memory_mib` adds.
    pub fn instance(vcpus: u32, memory_mib: u64) -> Self {
        ResourceUse { instances: 1, vcpus: u64::from(vcpus), memory_mib, sandboxes: 0 }
    }

    /// What a resize from `(vcpus, memory_mib)` to `to` adds: its growth (a shrink adds nothing).
    pub fn growth(from: (u32, u64), to: (u32, u64)) -> Self {
        ResourceUse {
            instances: 0,
            vcpus: u64::from(to.0.saturating_sub(from.0)),
            memory_mib: to.1.saturating_sub(from.1),
            sandboxes: 0,
        }
    }

    /// What one sandbox of `vcpus` and `memory_mib` adds.
    pub fn sandbox(vcpus: u32, memory_mib: u64) -> Self {
        ResourceUse { instances: 0, vcpus: u64::from(vcpus), memory_mib, sandboxes: 1 }
    }

    /// Whether it adds anything.
    pub fn is_empty(&self) -> bool {
        *self == ResourceUse::default()
    }

    pub fn add(&mut self, other: &ResourceUse) {
        self.instances = self.instances.saturating_add(other.instances);
        self.vcpus = self.vcpus.saturating_add(other.vcpus);
        self.memory_mib = self.memory_mib.saturating_add(other.memory_mib);
        self.sandboxes = self.sandboxes.saturating_add(other.sandboxes);
    }
}

/// The guard on the quota's stream, and the `quota.counted` event on it, a work's append adds.
pub type Counted = ((String, ExpectedVersion), NewEvent);

/// A tenant's quota in a pool as read, and its live work there (without the work decided).
#[derive(Clone, Copy, Debug)]
pub struct QuotaRead<'a> {
    pub quota: &'a QuotaDoc,
    pub in_use: ResourceUse,
}

impl QuotaDoc {
    /// Whether the quota bounds anything besides GPUs.
    pub fn bounds_resources(&self) -> bool {
        self.instances.is_some() || self.vcpus.is_some() || self.memory_mib.is_some() || self.sandboxes.is_some()
    }
}

/// Whether `adding` (an instance, a resize's growth, a sandbox) fits `read`'s quota on top of
/// its use: `QUOTA_EXCEEDED` naming the first resource past its limit, its limit and its use
/// otherwise. When the quota bounds any of these resources, answers the guard on the quota's
/// stream at the version read and the `quota.counted` event the work's append carries on it, so
/// two appends deciding on the same use cannot both land (one is `CONFLICT`); `None` when it
/// bounds none (or there is no quota: nothing to count against).
pub fn admit(read: Option<&QuotaRead<'_>>, adding: &ResourceUse, subject: &str) -> Result<Option<Counted>> {
    let Some(read) = read else { return Ok(None) };
    let q = read.quota;
    if !q.bounds_resources() {
        return Ok(None);
    }
    if let Some(past) = past_limit(read, adding) {
        return Err(Error::QuotaExceeded(format!(
            "{} more {} would take the tenant to {} of its quota of {} {} in pool {} (in use: {})",
            past.requested,
            past.what,
            past.in_use.saturating_add(past.requested),
            past.limit,
            past.what,
            q.pool_id,
            past.in_use
        )));
    }
    let stream = stream_of(KIND_QUOTA, &q.pool_id);
    let counted = ev::QuotaCounted {
        subject: subject.to_owned(),
        instances: adding.instances,
        vcpus: adding.vcpus,
        memory_mib: adding.memory_mib,
        sandboxes: adding.sandboxes,
    };
    let mut event = NewEvent::new(ev::QUOTA_COUNTED, to_cbor(&counted)?);
    event.stream = Some(stream.clone());
    Ok(Some(((stream, ExpectedVersion::Exact(q.version)), event)))
}

/// The first of the quota's resource limits `adding` would take the tenant past.
struct PastLimit {
    /// As a message names it.
    what: &'static str,
    /// As `quotas.set` names it.
    field: &'static str,
    requested: u64,
    in_use: u64,
    limit: u64,
}

fn past_limit(read: &QuotaRead<'_>, adding: &ResourceUse) -> Option<PastLimit> {
    let (q, u) = (read.quota, &read.in_use);
    let checks: [(&str, &str, Option<u64>, u64, u64); 4] = [
        ("instances", "instances", q.instances.map(u64::from), u64::from(u.instances), u64::from(adding.instances)),
        ("vCPUs", "vcpus", q.vcpus.map(u64::from), u.vcpus, adding.vcpus),
        ("memory (MiB)", "memoryMiB", q.memory_mib, u.memory_mib, adding.memory_mib),
        ("sandboxes", "sandboxes", q.sandboxes.map(u64::from), u64::from(u.sandboxes), u64::from(adding.sandboxes)),
    ];
    checks.into_iter().find_map(|(what, field, limit, in_use, requested)| {
        let limit = limit?;
        (requested > 0 && in_use.saturating_add(requested) > limit).then_some(PastLimit { what, field, requested, in_use, limit })
    })
}

/// The record of [`admit`]'s refusal: `quota.resource_exceeded` on the quota's stream, naming the
/// limit `adding` would pass, for an append of its own (any version: a refusal guards nothing),
/// as a reservation's refusal is recorded. `None` when `adding` passes no limit of the quota
/// read (the refusal was another's).
pub fn refusal_record(read: Option<&QuotaRead<'_>>, adding: &ResourceUse, subject: &str, actor: &str) -> Result<Option<Append>> {
    let Some(read) = read else { return Ok(None) };
    let Some(past) = past_limit(read, adding) else { return Ok(None) };
    let record = ev::QuotaResourceExceeded {
        resource: past.field.to_owned(),
        requested: past.requested,
        in_use: past.in_use,
        limit: past.limit,
        subject: subject.to_owned(),
        actor: actor.to_owned(),
    };
    Ok(Some(Append {
        stream: stream_of(KIND_QUOTA, &read.quota.pool_id),
        expected: ExpectedVersion::Any,
        guards: vec![],
        events: vec![NewEvent::new(ev::QUOTA_RESOURCE_EXCEEDED, to_cbor(&record)?)],
    }))
}

/// Each limit of `quotas.set` checked at the edge: within its bound (`QUOTA_*_MAX`).
pub fn check_limits(instances: Option<i64>, vcpus: Option<i64>, memory_mib: Option<i64>, sandboxes: Option<i64>) -> Result<()> {
    let bounds = [
        ("instances", instances, i64::from(QUOTA_COUNT_MAX), "QUOTA_COUNT_MAX"),
        ("vcpus", vcpus, i64::from(QUOTA_VCPUS_MAX), "QUOTA_VCPUS_MAX"),
        ("memoryMiB", memory_mib, QUOTA_MEMORY_MIB_MAX as i64, "QUOTA_MEMORY_MIB_MAX"),
        ("sandboxes", sandboxes, i64::from(QUOTA_COUNT_MAX), "QUOTA_COUNT_MAX"),
    ];
    for (field, value, max, name) in bounds {
        if let Some(v) = value
            && !(0..=max).contains(&v)
        {
            return Err(Error::invalid(format!("{field} must be 0 to {max} ({name}), not {v}")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use bc_core::ErrorCode;

    use super::*;

    fn quota(instances: Option<u32>, vcpus: Option<u32>, memory_mib: Option<u64>, sandboxes: Option<u32>) -> QuotaDoc {
        QuotaDoc {
            tenant_id: "ten_1".into(),
            pool_id: "pool_1".into(),
            gpus: 8,
            instances,
            vcpus,
            memory_mib,
            sandboxes,
            version: 4,
            updated_at_ms: 0,
        }
    }

    fn one_instance(vcpus: u64, memory_mib: u64) -> ResourceUse {
        ResourceUse { instances: 1, vcpus, memory_mib, sandboxes: 0 }
    }

    #[test]
    fn work_within_every_limit_is_counted_on_the_quota_at_the_version_read() {
        let q = quota(Some(2), Some(16), Some(4096), Some(3));
        let read = QuotaRead { quota: &q, in_use: one_instance(8, 2048) };
        let (guard, event) = admit(Some(&read), &one_instance(8, 2048), "inst_2").unwrap().expect("counted");
        assert_eq!(guard, ("quota/pool_1".to_owned(), ExpectedVersion::Exact(4)));
        assert_eq!((event.event_type.as_str(), event.stream.as_deref()), (ev::QUOTA_COUNTED, Some("quota/pool_1")));
        let counted: ev::QuotaCounted = ciborium::Value::deserialized(&event.payload).unwrap();
        assert_eq!(
            counted,
            ev::QuotaCounted { subject: "inst_2".into(), instances: 1, vcpus: 8, memory_mib: 2048, sandboxes: 0 }
        );
        // No quota, or one of GPUs alone: nothing to count.
        assert!(admit(None, &one_instance(8, 2048), "inst_2").unwrap().is_none());
        let gpus_only = quota(None, None, None, None);
        let read = QuotaRead { quota: &gpus_only, in_use: one_instance(1000, 1 << 30) };
        assert!(admit(Some(&read), &one_instance(8, 2048), "inst_2").unwrap().is_none());
    }

    #[test]
    fn each_resource_past_its_limit_is_quota_exceeded_naming_it_its_limit_and_its_use() {
        let cases = [
            (quota(Some(1), None, None, None), one_instance(1, 1), "instances", "quota of 1 instances", "in use: 1"),
            (quota(None, Some(8), None, None), one_instance(4, 1), "vCPUs", "quota of 8 vCPUs", "in use: 6"),
            (
                quota(None, None, Some(1024), None),
                one_instance(1, 512),
                "memory (MiB)",
                "quota of 1024 memory (MiB)",
                "in use: 600",
            ),
        ];
        for (q, adding, what, limit, in_use) in cases {
            let read = QuotaRead { quota: &q, in_use: ResourceUse { instances: 1, vcpus: 6, memory_mib: 600, sandboxes: 0 } };
            let err = admit(Some(&read), &adding, "inst_2").unwrap_err();
            assert_eq!(err.code(), ErrorCode::QuotaExceeded, "{err}");
            let text = err.to_string();
            assert!(text.contains(what) && text.contains(limit) && text.contains(in_use) && text.contains("pool_1"), "{text}");
        }
        let q = quota(None, None, None, Some(2));
        let read = QuotaRead { quota: &q, in_use: ResourceUse { sandboxes: 2, ..ResourceUse::default() } };
        let sandbox = ResourceUse { sandboxes: 1, vcpus: 1, memory_mib: 128, instances: 0 };
        let err = admit(Some(&read), &sandbox, "sbx_3").unwrap_err();
        assert!(err.to_string().contains("quota of 2 sandboxes"), "{err}");
        // A resize that adds nothing of a resource at its limit passes (a shrink always does).
        let q = quota(Some(1), Some(8), None, None);
        let read = QuotaRead { quota: &q, in_use: one_instance(8, 1) };
        assert!(admit(Some(&read), &ResourceUse::default(), "inst_1").unwrap().is_some());
        assert!(admit(Some(&read), &ResourceUse { vcpus: 1, ..ResourceUse::default() }, "inst_1").is_err());
    }

    #[test]
    fn a_refusal_is_recorded_naming_the_limit_passed_and_a_refusal_of_another_is_not() {
        let q = quota(Some(4), Some(8), None, None);
        let read = QuotaRead { quota: &q, in_use: one_instance(6, 512) };
        let adding = one_instance(4, 1024);
        assert!(admit(Some(&read), &adding, "inst_2").is_err());
        let record = refusal_record(Some(&read), &adding, "inst_2", "key:ak_1").unwrap().expect("a record");
        assert_eq!((record.stream.as_str(), record.expected, record.guards.len()), ("quota/pool_1", ExpectedVersion::Any, 0));
        assert_eq!(record.events.len(), 1);
        assert_eq!(record.events[0].event_type, ev::QUOTA_RESOURCE_EXCEEDED);
        let payload: ev::QuotaResourceExceeded = ciborium::Value::deserialized(&record.events[0].payload).unwrap();
        assert_eq!(
            payload,
            ev::QuotaResourceExceeded {
                resource: "vcpus".into(),
                requested: 4,
                in_use: 6,
                limit: 8,
                subject: "inst_2".into(),
                actor: "key:ak_1".into()
            }
        );
        // Work that fits, no quota, or no limit on what it adds: nothing to record.
        assert!(refusal_record(Some(&read), &one_instance(2, 1), "inst_2", "a").unwrap().is_none());
        assert!(refusal_record(None, &adding, "inst_2", "a").unwrap().is_none());
        let gpus_only = quota(None, None, None, None);
        let read = QuotaRead { quota: &gpus_only, in_use: one_instance(1000, 1 << 30) };
        assert!(refusal_record(Some(&read), &adding, "inst_2", "a").unwrap().is_none());
    }

    #[test]
    fn limits_are_bounded_at_the_edge() {
        check_limits(Some(0), Some(0), Some(0), Some(0)).unwrap();
        check_limits(None, Some(i64::from(QUOTA_VCPUS_MAX)), None, None).unwrap();
        for bad in [
            check_limits(Some(-1), None, None, None),
            check_limits(None, Some(i64::from(QUOTA_VCPUS_MAX) + 1), None, None),
            check_limits(None, None, Some(QUOTA_MEMORY_MIB_MAX as i64 + 1), None),
            check_limits(None, None, None, Some(i64::from(QUOTA_COUNT_MAX) + 1)),
        ] {
            assert_eq!(bad.unwrap_err().code(), ErrorCode::InvalidArgument);
        }
    }
}
