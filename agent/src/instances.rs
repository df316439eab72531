//! The node's instances: the ledger of what it was asked to run (`instances.json` in the data
//! directory, 0600, written whole before the machine is touched), what an `instance.apply`
//! asks ([`Apply`], parsed and checked by [`parse_apply`]), and the pure decision of what to do
//! about one ([`decide_apply`]) over the instance's ledger entry, the holds ledger, the request
//! and what the hypervisor says of the domain. The runner carries the decision out.
//!
//! The protocol, shared with the control plane, is in `schema/EVENTS.md` (`instance.apply`'s
//! arguments, `instance.observed`, `instance.apply_failed`): an apply names a generation; one older than the ledger's is stale and answered with what the
//! node observes, nothing done; an instance runs only on the GPUs the holds ledger holds for its
//! reservation (`gpus-not-held` otherwise).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::binding::HeldGpu;
use crate::holds::Ledger as HoldsLedger;
use crate::hypervisor::{DomainState, MEMORY_MIB_MAX, Observed, VCPUS_MAX};

/// Instances one node runs at most (each runs on a reservation's GPUs, and a node holds GPUs
/// for at most [`crate::holds::HOLDS_MAX`] reservations).
pub const INSTANCES_MAX: usize = 256;
/// The largest disk an instance is given.
pub const DISK_GIB_MAX: u64 = 64 * 1024;
/// GPUs one instance is given at most (a node has at most 64).
pub const INSTANCE_GPUS_MAX: usize = 64;
/// The longest image URL taken.
pub const IMAGE_URL_BYTES_MAX: usize = 4096;
/// Bytes in a GiB.
pub const GIB: u64 = 1024 * 1024 * 1024;

const _: () = assert!(DISK_GIB_MAX.checked_mul(GIB).is_some());

/// What an instance should be.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Desired {
    Running,
    Stopped,
    Deleted,
}

/// An image's disk format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiskFormat {
    Qcow2,
    Raw,
    /// A root file system as a tar archive: a sandbox's (`crate::sandboxes`), never an
    /// instance's disk.
    #[serde(rename = "rootfs-tar")]
    RootfsTar,
}

impl DiskFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Qcow2 => "qcow2",
            Self::Raw => "raw",
            Self::RootfsTar => "rootfs-tar",
        }
    }
}

/// The image an instance boots from, as the apply names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ImageRef {
    pub image_id: String,
    pub url: String,
    /// 64 lowercase hex digits: the cache's name for it.
    pub sha256: String,
    pub disk_format: DiskFormat,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
}

/// What an apply for a running or stopped instance asks.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ApplyArgs {
    pub reservation_id: String,
    pub vcpus: u32,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    #[serde(rename = "diskGiB")]
    pub disk_gib: u64,
    /// The reservation's GPU UUIDs, in order.
    pub gpus: Vec<String>,
    pub image: ImageRef,
}

/// The part every apply is read for; a delete needs no more.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ApplyHead {
    pub instance_id: String,
    pub generation: u64,
    pub desired: Desired,
}

/// An `instance.apply`, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Apply {
    pub instance_id: String,
    pub generation: u64,
    pub request: Request,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    Delete,
    /// Running (`start`) or stopped.
    Make {
        start: bool,
        args: ApplyArgs,
    },
}

/// Arguments that do not make an apply: the reason (`bad-args: …`), and the instance and
/// generation when they could be read (the answer then goes to the instance's stream).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadArgs {
    pub head: Option<(String, u64)>,
    pub reason: String,
}

/// Whether `text` is an instance id: `inst_` and a ULID. It names a directory and a domain, so
/// nothing else is taken.
pub fn is_instance_id(text: &str) -> bool {
    let Some(body) = text.strip_prefix("inst_") else { return false };
    body.len() == 26 && body.starts_with(|c: char| ('0'..='7').contains(&c)) && ulid::Ulid::from_string(body).is_ok()
}

/// Whether `text` is a SHA-256 digest as the cache names files: 64 lowercase hex digits.
pub fn is_sha256(text: &str) -> bool {
    text.len() == 64 && text.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Reads and checks an `instance.apply`'s arguments.
pub fn parse_apply(args_json: &str) -> Result<Apply, BadArgs> {
    let short = |e: serde_json::Error| bc_core::id::truncate(&e.to_string(), 200);
    let head: ApplyHead = serde_json::from_str(args_json)
        .map_err(|e| BadArgs { head: None, reason: format!("bad-args: instance.apply: {}", short(e)) })?;
    if !is_instance_id(&head.instance_id) {
        return Err(BadArgs { head: None, reason: "bad-args: instance.apply names no instance (inst_…)".into() });
    }
    let bad = |reason: String| BadArgs { head: Some((head.instance_id.clone(), head.generation)), reason };
    let start = match head.desired {
        Desired::Deleted => {
            return Ok(Apply { instance_id: head.instance_id, generation: head.generation, request: Request::Delete });
        }
        Desired::Running => true,
        Desired::Stopped => false,
    };
    let args: ApplyArgs = serde_json::from_str(args_json).map_err(|e| bad(format!("bad-args: instance.apply: {}", short(e))))?;
    if args.reservation_id.parse::<bc_core::id::ReservationId>().is_err() {
        return Err(bad("bad-args: instance.apply names no reservation".into()));
    }
    if args.vcpus == 0 || args.vcpus > VCPUS_MAX || args.memory_mib == 0 || args.memory_mib > MEMORY_MIB_MAX {
        return Err(bad(format!("bad-args: an instance has 1 to {VCPUS_MAX} vCPUs and 1 to {MEMORY_MIB_MAX} MiB")));
    }
    if args.disk_gib == 0 || args.disk_gib > DISK_GIB_MAX {
        return Err(bad(format!("bad-args: an instance's disk is 1 to {DISK_GIB_MAX} GiB")));
    }
    if args.gpus.len() > INSTANCE_GPUS_MAX {
        return Err(bad(format!("bad-args: an instance has at most {INSTANCE_GPUS_MAX} GPUs")));
    }
    if args.image.disk_format == DiskFormat::RootfsTar {
        return Err(bad("bad-args: the image is a root file system (rootfs-tar), a sandbox's, not an instance's disk".into()));
    }
    if !is_sha256(&args.image.sha256) {
        return Err(bad("bad-args: the image's sha256 is not 64 lowercase hex digits".into()));
    }
    if args.image.url.len() > IMAGE_URL_BYTES_MAX
        || !reqwest::Url::parse(&args.image.url).is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some())
    {
        return Err(bad(format!("bad-args: the image URL is not an http(s) URL of at most {IMAGE_URL_BYTES_MAX} bytes")));
    }
    Ok(Apply { instance_id: head.instance_id, generation: head.generation, request: Request::Make { start, args } })
}

/// One instance the node was asked to run: what the last apply it took asked.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Instance {
    pub reservation_id: String,
    /// The generation last applied (or being applied).
    pub generation: u64,
    pub command_id: String,
    pub desired: Desired,
    pub vcpus: u32,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    #[serde(rename = "diskGiB")]
    pub disk_gib: u64,
    pub gpus: Vec<HeldGpu>,
    pub image_sha256: String,
    pub disk_format: DiskFormat,
}

/// Instance id → what the node was asked to run.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceLedger {
    pub instances: BTreeMap<String, Instance>,
}

impl crate::ledger::LedgerContents for InstanceLedger {
    const FILE: &'static str = "instances.json";
}

/// The instance ledger on disk (`instances.json`).
pub type InstanceLedgerFile = crate::ledger::LedgerFile<InstanceLedger>;

/// One step of an apply, in the order given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// The image in the cache (fetched if need be) and the instance's disk copied from it once
    /// (a raw one grown to the disk size).
    PrepareDisk,
    /// The domain stopped: an ACPI shutdown given a grace, then forced; or forced at once.
    Stop {
        graceful: bool,
    },
    /// The domain (re)defined with the apply's shape and the held GPUs.
    Define,
    Start,
}

/// What to do about an apply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ApplyDecision {
    /// Older than what the node applied: answer with what it observes, at the ledger's
    /// generation; do nothing.
    Stale { generation: u64 },
    /// Refused, with the reason (a stable code, a colon, and words).
    Refuse(String),
    /// Delete the domain, the instance's directory and its ledger entry.
    Delete,
    /// Record the instance with these GPUs, then take these steps.
    Apply { gpus: Vec<HeldGpu>, steps: Vec<Step> },
}

/// What to do about `apply` for an instance whose ledger entry is `entry`, on a node holding
/// `holds`, whose hypervisor says `observed` of the domain (`None`: no such domain).
pub fn decide_apply(entry: Option<&Instance>, holds: &HoldsLedger, apply: &Apply, observed: Option<&Observed>) -> ApplyDecision {
    if let Some(entry) = entry
        && apply.generation < entry.generation
    {
        return ApplyDecision::Stale { generation: entry.generation };
    }
    let (start, args) = match &apply.request {
        Request::Delete => return ApplyDecision::Delete,
        Request::Make { start, args } => (*start, args),
    };
    if let Some(entry) = entry
        && entry.reservation_id != args.reservation_id
    {
        return ApplyDecision::Refuse(format!(
            "bad-args: {} runs on {} here, not {}",
            apply.instance_id, entry.reservation_id, args.reservation_id
        ));
    }
    let held = holds.holds.get(&args.reservation_id).filter(|h| h.release_command_id.is_none());
    let gpus = match held {
        Some(hold) if hold.gpus.iter().map(|g| g.uuid.as_str()).eq(args.gpus.iter().map(String::as_str)) => hold.gpus.clone(),
        Some(_) => {
            return ApplyDecision::Refuse(format!(
                "gpus-not-held: this node holds other GPUs for {} than the instance names",
                args.reservation_id
            ));
        }
        None => {
            return ApplyDecision::Refuse(format!(
                "gpus-not-held: this node holds no GPUs for {} (or their release is pending)",
                args.reservation_id
            ));
        }
    };
    let mut steps = vec![Step::PrepareDisk];
    let then_start = |steps: &mut Vec<Step>| {
        steps.push(Step::Define);
        if start {
            steps.push(Step::Start);
        }
    };
    match observed {
        None => then_start(&mut steps),
        Some(o) if o.state == DomainState::Stopped => then_start(&mut steps),
        Some(o) if o.state == DomainState::Running => {
            let reshaped = o.vcpus != args.vcpus
                || o.memory_mib != args.memory_mib
                || entry.is_none_or(|e| e.gpus != gpus || e.disk_gib != args.disk_gib);
            if reshaped {
                // Resized while running: stopped, redefined, started again if it should run.
                steps.push(Step::Stop { graceful: true });
                then_start(&mut steps);
            } else if !start {
                steps.push(Step::Stop { graceful: true });
            }
        }
        // Paused, crashed, shutting down or unknown: stopped at once, then made what it should be.
        Some(_) => {
            steps.push(Step::Stop { graceful: false });
            then_start(&mut steps);
        }
    }
    ApplyDecision::Apply { gpus, steps }
}

/// What the node says of an instance: the domain's state (`absent`: no such domain) and, when
/// it exists, its shape. The observer journals a change of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    pub state: &'static str,
    pub vcpus: Option<u32>,
    pub memory_mib: Option<u64>,
}

impl Report {
    pub fn of(observed: Option<&Observed>) -> Self {
        match observed {
            None => Self { state: "absent", vcpus: None, memory_mib: None },
            Some(o) => Self { state: o.state.as_str(), vcpus: Some(o.vcpus), memory_mib: Some(o.memory_mib) },
        }
    }

    pub fn absent() -> Self {
        Self::of(None)
    }

    /// The `instance.observed` payload (without `nodeId` and `commandId`, which the runner adds).
    pub fn payload(&self, instance_id: &str, generation: u64) -> Value {
        let mut payload = json!({ "instanceId": instance_id, "generation": generation, "state": self.state });
        if let Some(vcpus) = self.vcpus {
            payload["vcpus"] = json!(vcpus);
        }
        if let Some(memory_mib) = self.memory_mib {
            payload["memoryMiB"] = json!(memory_mib);
        }
        payload
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::holds::Hold;

    const INST: &str = "inst_01J00000000000000000000000";
    const RSV: &str = "rsv_01J00000000000000000000000";

    fn gpu(i: u32) -> HeldGpu {
        HeldGpu { uuid: format!("GPU-{i}"), pci_address: format!("0000:{:02x}:00.0", 0x10 + i) }
    }

    fn holds(release_pending: bool) -> HoldsLedger {
        let mut ledger = HoldsLedger::default();
        let release_command_id = release_pending.then(|| "cmd_release".to_owned());
        ledger.holds.insert(RSV.into(), Hold { command_id: "cmd_hold".into(), gpus: vec![gpu(0), gpu(1)], release_command_id });
        ledger
    }

    fn args_json(generation: u64, desired: &str, vcpus: u32) -> String {
        json!({
            "instanceId": INST, "generation": generation, "desired": desired, "reservationId": RSV,
            "vcpus": vcpus, "memoryMiB": 4096, "diskGiB": 20, "gpus": ["GPU-0", "GPU-1"],
            "image": { "imageId": "img_01J00000000000000000000000", "url": "https://images.example/u.qcow2?sig=x",
                       "sha256": "ab".repeat(32), "diskFormat": "qcow2" },
        })
        .to_string()
    }

    fn apply(generation: u64, desired: &str, vcpus: u32) -> Apply {
        parse_apply(&args_json(generation, desired, vcpus)).unwrap()
    }

    fn entry(generation: u64, vcpus: u32) -> Instance {
        Instance {
            reservation_id: RSV.into(),
            generation,
            command_id: "cmd_1".into(),
            desired: Desired::Running,
            vcpus,
            memory_mib: 4096,
            disk_gib: 20,
            gpus: vec![gpu(0), gpu(1)],
            image_sha256: "ab".repeat(32),
            disk_format: DiskFormat::Qcow2,
        }
    }

    fn observed(state: DomainState, vcpus: u32) -> Observed {
        Observed { state, vcpus, memory_mib: 4096 }
    }

    fn steps(decision: ApplyDecision) -> Vec<Step> {
        match decision {
            ApplyDecision::Apply { gpus, steps } => {
                assert_eq!(gpus, vec![gpu(0), gpu(1)]);
                steps
            }
            other => panic!("not an apply: {other:?}"),
        }
    }

    #[test]
    fn the_arguments_are_checked_and_a_delete_needs_only_its_head() {
        let Request::Make { start, args } = apply(3, "running", 8).request else { panic!("a make") };
        assert!(start);
        assert_eq!((args.vcpus, args.memory_mib, args.disk_gib, args.image.disk_format), (8, 4096, 20, DiskFormat::Qcow2));
        let delete = parse_apply(&json!({ "instanceId": INST, "generation": 4, "desired": "deleted" }).to_string()).unwrap();
        assert_eq!(delete, Apply { instance_id: INST.into(), generation: 4, request: Request::Delete });

        let no_id = parse_apply(&json!({ "instanceId": "../etc", "generation": 1, "desired": "deleted" }).to_string());
        assert_eq!(no_id.unwrap_err().head, None);
        let bad = |text: String| {
            let e = parse_apply(&text).unwrap_err();
            assert_eq!(e.head, Some((INST.to_owned(), 3)));
            assert!(e.reason.starts_with("bad-args: "), "{}", e.reason);
        };
        bad(args_json(3, "running", 0));
        bad(args_json(3, "running", VCPUS_MAX + 1));
        bad(args_json(3, "running", 8).replace(&"ab".repeat(32), &"AB".repeat(32)));
        bad(args_json(3, "running", 8).replace("https://images.example", "file:///etc"));
        bad(args_json(3, "running", 8).replace(RSV, "rsv_nope"));
        bad(args_json(3, "stopped", 8).replace("\"diskGiB\":20", "\"diskGiB\":0"));
        assert!(is_instance_id(INST) && !is_instance_id("inst_81J00000000000000000000000") && !is_instance_id("inst_x"));
    }

    #[test]
    fn a_new_instance_is_prepared_defined_and_started_on_the_held_gpus() {
        let decided = decide_apply(None, &holds(false), &apply(1, "running", 8), None);
        assert_eq!(steps(decided), vec![Step::PrepareDisk, Step::Define, Step::Start]);
        let stopped = decide_apply(None, &holds(false), &apply(1, "stopped", 8), None);
        assert_eq!(steps(stopped), vec![Step::PrepareDisk, Step::Define]);
    }

    #[test]
    fn an_older_generation_is_stale_and_the_same_one_is_applied_again() {
        let running = observed(DomainState::Running, 8);
        let decided = decide_apply(Some(&entry(5, 8)), &holds(false), &apply(4, "stopped", 8), Some(&running));
        assert_eq!(decided, ApplyDecision::Stale { generation: 5 });
        let deleted = decide_apply(Some(&entry(5, 8)), &holds(false), &apply(4, "deleted", 8), Some(&running));
        assert_eq!(deleted, ApplyDecision::Stale { generation: 5 });
        let again = decide_apply(Some(&entry(5, 8)), &holds(false), &apply(5, "running", 8), Some(&running));
        assert_eq!(steps(again), vec![Step::PrepareDisk], "already so: nothing to change");
    }

    #[test]
    fn an_instance_runs_only_on_the_gpus_held_for_its_reservation() {
        let refused = |holds: &HoldsLedger, apply: &Apply| match decide_apply(None, holds, apply, None) {
            ApplyDecision::Refuse(reason) => reason,
            other => panic!("not refused: {other:?}"),
        };
        assert!(refused(&HoldsLedger::default(), &apply(1, "running", 8)).starts_with("gpus-not-held: "));
        assert!(refused(&holds(true), &apply(1, "running", 8)).starts_with("gpus-not-held: "), "a release is pending");
        let other_gpus = parse_apply(&args_json(1, "running", 8).replace("\"GPU-0\",", "")).unwrap();
        assert!(refused(&holds(false), &other_gpus).starts_with("gpus-not-held: "));
        // A delete needs no GPUs: they may be gone already.
        assert_eq!(
            decide_apply(Some(&entry(1, 8)), &HoldsLedger::default(), &apply(2, "deleted", 8), None),
            ApplyDecision::Delete
        );
        let elsewhere = parse_apply(&args_json(2, "running", 8).replace(RSV, "rsv_01J00000000000000000000001")).unwrap();
        let moved = decide_apply(Some(&entry(1, 8)), &holds(false), &elsewhere, None);
        assert!(matches!(moved, ApplyDecision::Refuse(r) if r.starts_with("bad-args: ")));
    }

    #[test]
    fn a_resize_while_running_stops_redefines_and_starts_again() {
        let running = observed(DomainState::Running, 8);
        let resized = decide_apply(Some(&entry(1, 8)), &holds(false), &apply(2, "running", 16), Some(&running));
        assert_eq!(steps(resized), vec![Step::PrepareDisk, Step::Stop { graceful: true }, Step::Define, Step::Start]);
        let resized_and_stopped = decide_apply(Some(&entry(1, 8)), &holds(false), &apply(2, "stopped", 16), Some(&running));
        assert_eq!(steps(resized_and_stopped), vec![Step::PrepareDisk, Step::Stop { graceful: true }, Step::Define]);
        let stop = decide_apply(Some(&entry(1, 8)), &holds(false), &apply(2, "stopped", 8), Some(&running));
        assert_eq!(steps(stop), vec![Step::PrepareDisk, Step::Stop { graceful: true }]);
        let crashed = observed(DomainState::Crashed, 8);
        let restart = decide_apply(Some(&entry(1, 8)), &holds(false), &apply(2, "running", 8), Some(&crashed));
        assert_eq!(steps(restart), vec![Step::PrepareDisk, Step::Stop { graceful: false }, Step::Define, Step::Start]);
        let stopped = observed(DomainState::Stopped, 8);
        let start = decide_apply(Some(&entry(1, 8)), &holds(false), &apply(2, "running", 16), Some(&stopped));
        assert_eq!(steps(start), vec![Step::PrepareDisk, Step::Define, Step::Start]);
    }

    #[test]
    fn a_report_is_the_protocols_payload() {
        let report = Report::of(Some(&observed(DomainState::Running, 8)));
        assert_eq!(
            report.payload(INST, 3),
            json!({ "instanceId": INST, "generation": 3, "state": "running", "vcpus": 8, "memoryMiB": 4096 })
        );
        assert_eq!(Report::absent().payload(INST, 3), json!({ "instanceId": INST, "generation": 3, "state": "absent" }));
    }
}
