//! A node's past inventories and what changed between two of them.
//!
//! Every `node.inventory_reported` is also kept as its own row (kind [`KIND_INVENTORY`]), so
//! `inventory.history` pages a node's reports newest first without scanning its agent stream,
//! which grows with every `node.observed`. The row id is the node id and the event's log
//! sequence counted down ([`inventory_row_id`]): ids sort by node, then newest first, which is
//! the order `row_list` hands them back in. Only the event's `seq` is kept, not its position:
//! the commit number is not known while the fold runs, and the sequence names the event as well.
//!
//! The payload of `node.inventory_reported` ([`NodeInventoryReported`]) is here too; the node's
//! own fold of it (its GPUs, its journal head) is in [`crate::node`].
//!
//! [`inventory_diff`] is pure: two reports in, what changed out (GPUs by UUID, the host field
//! by field, the driver, CUDA and NVML's availability).

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One row per inventory report: `NODE_SEQDOWN` (see [`inventory_row_id`]).
pub const KIND_INVENTORY: &str = "inventory";

pub const NODE_INVENTORY_REPORTED: &str = "node.inventory_reported";

/// What a node's agent found on its machine (NVML and `/proc`, `/sys`), at its first session
/// and whenever it changes; on `agent/node_…`. The node's GPUs are taken from it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeInventoryReported {
    pub node_id: String,
    pub gpus: Vec<InventoryGpu>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_version: Option<String>,
    /// Why no GPUs could be read (no driver, no library).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unavailable: Option<String>,
    pub host: InventoryHost,
    /// What the agent can do with the machine (`command.ping`, `gpu.hold`, …).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub capabilities: Vec<String>,
    /// Why the agent cannot hold GPUs (`node-unprivileged: …`); absent when it can.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_unavailable: Option<String>,
    /// The size in bytes of the file system that holds the node's sandbox volumes, from an agent
    /// that makes them (`sandbox-volume.ext4`): the sum of its volumes' sizes is bounded by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_file_system_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal: Option<bc_core::agent::JournalOrigin>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[derive(schemars::JsonSchema)]
pub struct InventoryGpu {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub product: String,
    #[serde(rename = "vramGiB")]
    pub vram_gib: u32,
    pub pci_bus_id: String,
    pub nvlink_domain: u32,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[derive(schemars::JsonSchema)]
pub struct InventoryHost {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_model: Option<String>,
    pub cpus: u32,
    #[serde(rename = "memoryKiB")]
    pub memory_kib: u64,
    pub disks: Vec<InventoryDisk>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vendor: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub product: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[derive(schemars::JsonSchema)]
pub struct InventoryDisk {
    pub name: String,
    pub bytes: u64,
    pub rotational: bool,
}

/// Digits of the counted-down sequence: `u64::MAX` has 20, so every id has the same length and
/// sorts as its number does.
const SEQ_DIGITS: usize = 20;

/// The row of the report that is event `seq` of the node's tenant: `node_…_` and `u64::MAX -
/// seq` in 20 digits, so that a newer report of the node sorts first.
pub fn inventory_row_id(node: &str, seq: u64) -> String {
    format!("{node}_{:0SEQ_DIGITS$}", u64::MAX - seq)
}

/// What every row id of the node starts with; as a `row_list` cursor it sorts before all of them.
pub fn inventory_row_prefix(node: &str) -> String {
    format!("{node}_")
}

/// The log sequence a row id of the node stands for (none: not one of the node's rows).
pub fn inventory_row_seq(node: &str, id: &str) -> Option<u64> {
    let digits = id.strip_prefix(&inventory_row_prefix(node))?;
    (digits.len() == SEQ_DIGITS && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse::<u64>().ok().map(|down| u64::MAX - down))
        .flatten()
}

/// One report as its row keeps it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct InventoryReportDoc {
    pub tenant_id: String,
    pub node_id: String,
    /// The event's sequence in the tenant's log, and its id.
    pub seq: u64,
    pub event_id: String,
    /// The entry of the node's journal it came in.
    pub journal_seq: u64,
    pub reported_at_ms: u64,
    /// The report, without its journal origin (the event keeps that).
    pub inventory: NodeInventoryReported,
}

/// One field that differs: its name and both values (`null`: absent).
#[derive(Clone, Debug, Serialize, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FieldChange {
    /// `driverVersion`, `memoryKiB`, `disks.nvme0n1`, …
    pub field: String,
    pub before: Value,
    pub after: Value,
}

/// A GPU with the same UUID in both reports whose other fields differ.
#[derive(Clone, Debug, Serialize, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuChange {
    pub uuid: String,
    pub changes: Vec<FieldChange>,
}

/// What changed from one report to another.
#[derive(Clone, Debug, Default, Serialize, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InventoryDiff {
    /// GPUs whose UUID only the later report has, in its index order.
    pub gpus_added: Vec<InventoryGpu>,
    /// GPUs whose UUID only the earlier report has, in its index order.
    pub gpus_removed: Vec<InventoryGpu>,
    /// GPUs in both, with the fields that differ (index, model, product, VRAM, PCI bus id,
    /// NVLink domain), by UUID.
    pub gpus_changed: Vec<GpuChange>,
    /// The driver and CUDA versions and NVML's `unavailable` reason.
    pub software_changed: Vec<FieldChange>,
    /// The host's CPU, memory, DMI fields, and disks by name (`disks.NAME`).
    pub host_changed: Vec<FieldChange>,
}

impl InventoryDiff {
    pub fn is_empty(&self) -> bool {
        self.gpus_added.is_empty()
            && self.gpus_removed.is_empty()
            && self.gpus_changed.is_empty()
            && self.software_changed.is_empty()
            && self.host_changed.is_empty()
    }
}

/// The fields of `before` and `after` (JSON objects) that differ, in field-name order, each
/// named `prefix` + its name.
fn object_changes(prefix: &str, before: Value, after: Value, skip: &[&str], out: &mut Vec<FieldChange>) {
    let (Value::Object(before), Value::Object(mut after)) = (before, after) else {
        return;
    };
    let mut fields: BTreeMap<String, (Value, Value)> = BTreeMap::new();
    for (name, value) in before {
        let later = after.remove(&name).unwrap_or(Value::Null);
        fields.insert(name, (value, later));
    }
    for (name, value) in after {
        fields.insert(name, (Value::Null, value));
    }
    for (name, (before, after)) in fields {
        if before != after && !skip.contains(&name.as_str()) {
            out.push(FieldChange { field: format!("{prefix}{name}"), before, after });
        }
    }
}

fn json_of<T: Serialize>(value: &T) -> Value {
    // The inventory types are plain data: serializing them cannot fail.
    serde_json::to_value(value).unwrap_or(Value::Null)
}

/// What changed from `before` to `after`. GPUs are matched by UUID (a GPU that moved to another
/// index is changed, not removed and added); disks by name. The node id and the journal origin
/// are not compared.
pub fn inventory_diff(before: &NodeInventoryReported, after: &NodeInventoryReported) -> InventoryDiff {
    let mut diff = InventoryDiff::default();
    let earlier: BTreeMap<&str, &InventoryGpu> = before.gpus.iter().map(|g| (g.uuid.as_str(), g)).collect();
    let later: BTreeMap<&str, &InventoryGpu> = after.gpus.iter().map(|g| (g.uuid.as_str(), g)).collect();
    diff.gpus_added = after.gpus.iter().filter(|g| !earlier.contains_key(g.uuid.as_str())).cloned().collect();
    diff.gpus_removed = before.gpus.iter().filter(|g| !later.contains_key(g.uuid.as_str())).cloned().collect();
    for (uuid, gpu) in &earlier {
        if let Some(now) = later.get(uuid)
            && gpu != now
        {
            let mut changes = Vec::new();
            object_changes("", json_of(gpu), json_of(now), &["uuid"], &mut changes);
            diff.gpus_changed.push(GpuChange { uuid: (*uuid).to_owned(), changes });
        }
    }
    let software = |r: &NodeInventoryReported| {
        serde_json::json!({
            "driverVersion": r.driver_version,
            "cudaVersion": r.cuda_version,
            "unavailable": r.unavailable,
            "capabilities": r.capabilities,
            "holdUnavailable": r.hold_unavailable,
        })
    };
    object_changes("", software(before), software(after), &[], &mut diff.software_changed);
    object_changes("", json_of(&before.host), json_of(&after.host), &["disks"], &mut diff.host_changed);
    let disks = |r: &NodeInventoryReported| {
        Value::Object(r.host.disks.iter().map(|d| (d.name.clone(), json_of(d))).collect::<serde_json::Map<_, _>>())
    };
    object_changes("disks.", disks(before), disks(after), &[], &mut diff.host_changed);
    diff
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::{InventoryDisk, InventoryHost};

    fn gpu(index: u32, uuid: &str) -> InventoryGpu {
        InventoryGpu {
            index,
            uuid: uuid.into(),
            model: "H100".into(),
            product: "H100-SXM5-80GB".into(),
            vram_gib: 80,
            pci_bus_id: format!("00000000:{:02X}:00.0", index + 0x10),
            nvlink_domain: 0,
        }
    }

    fn report(gpus: Vec<InventoryGpu>) -> NodeInventoryReported {
        NodeInventoryReported {
            node_id: "node_01J00000000000000000000000".into(),
            gpus,
            driver_version: Some("550.54".into()),
            cuda_version: Some("12.4".into()),
            unavailable: None,
            host: InventoryHost {
                cpu_model: Some("EPYC".into()),
                cpus: 64,
                memory_kib: 1 << 30,
                disks: vec![InventoryDisk { name: "nvme0n1".into(), bytes: 1 << 40, rotational: false }],
                vendor: Some("Fake".into()),
                product: Some("Box".into()),
                serial: Some("S1".into()),
            },
            capabilities: vec![],
            hold_unavailable: None,
            volume_file_system_bytes: None,
            journal: None,
        }
    }

    #[test]
    fn the_same_report_has_no_difference() {
        let a = report(vec![gpu(0, "GPU-a"), gpu(1, "GPU-b")]);
        assert!(inventory_diff(&a, &a).is_empty());
        // The journal origin and the node id are not what the machine holds.
        let mut b = a.clone();
        b.node_id = "node_01J00000000000000000000001".into();
        assert!(inventory_diff(&a, &b).is_empty());
    }

    #[test]
    fn gpus_are_matched_by_uuid_not_by_index() {
        let a = report(vec![gpu(0, "GPU-a"), gpu(1, "GPU-b")]);
        // GPU-a went away; GPU-b moved to index 0 (and its bus id with it); GPU-c came.
        let b = report(vec![gpu(0, "GPU-b"), gpu(1, "GPU-c")]);
        let diff = inventory_diff(&a, &b);
        assert_eq!(diff.gpus_removed, vec![gpu(0, "GPU-a")]);
        assert_eq!(diff.gpus_added, vec![gpu(1, "GPU-c")]);
        assert_eq!(diff.gpus_changed.len(), 1);
        let changed = &diff.gpus_changed[0];
        assert_eq!(changed.uuid, "GPU-b");
        let fields: Vec<&str> = changed.changes.iter().map(|c| c.field.as_str()).collect();
        assert_eq!(fields, ["index", "pciBusId"]);
        assert_eq!(changed.changes[0].before, 1);
        assert_eq!(changed.changes[0].after, 0);
        assert!(diff.software_changed.is_empty() && diff.host_changed.is_empty());
    }

    #[test]
    fn a_gpu_changed_in_place_shows_each_field_before_and_after() {
        let a = report(vec![gpu(0, "GPU-a")]);
        let mut b = a.clone();
        b.gpus[0].vram_gib = 94;
        b.gpus[0].nvlink_domain = 3;
        let diff = inventory_diff(&a, &b);
        assert!(diff.gpus_added.is_empty() && diff.gpus_removed.is_empty());
        assert_eq!(
            diff.gpus_changed[0].changes,
            vec![
                FieldChange { field: "nvlinkDomain".into(), before: 0.into(), after: 3.into() },
                FieldChange { field: "vramGiB".into(), before: 80.into(), after: 94.into() },
            ]
        );
    }

    #[test]
    fn the_driver_cuda_and_nvml_availability_are_software_changes() {
        let a = report(vec![gpu(0, "GPU-a")]);
        let mut b = report(vec![]);
        b.driver_version = None;
        b.cuda_version = Some("12.6".into());
        b.unavailable = Some("NVML: library not found".into());
        let diff = inventory_diff(&a, &b);
        assert_eq!(diff.gpus_removed.len(), 1);
        assert_eq!(
            diff.software_changed,
            vec![
                FieldChange { field: "cudaVersion".into(), before: "12.4".into(), after: "12.6".into() },
                FieldChange { field: "driverVersion".into(), before: "550.54".into(), after: Value::Null },
                FieldChange { field: "unavailable".into(), before: Value::Null, after: "NVML: library not found".into() },
            ]
        );
        // What the agent can do is part of it: losing the privilege to hold GPUs shows.
        let mut c = a.clone();
        c.capabilities = vec!["command.ping".into()];
        c.hold_unavailable = Some("node-unprivileged: no vfio-pci".into());
        let fields: Vec<String> = inventory_diff(&a, &c).software_changed.into_iter().map(|f| f.field).collect();
        assert_eq!(fields, ["capabilities", "holdUnavailable"]);
    }

    #[test]
    fn host_fields_and_disks_by_name() {
        let a = report(vec![]);
        let mut b = a.clone();
        b.host.memory_kib *= 2;
        b.host.serial = None;
        b.host.disks[0].bytes = 2 << 40;
        b.host.disks.push(InventoryDisk { name: "sda".into(), bytes: 1 << 30, rotational: true });
        let diff = inventory_diff(&a, &b);
        let fields: Vec<&str> = diff.host_changed.iter().map(|c| c.field.as_str()).collect();
        assert_eq!(fields, ["memoryKiB", "serial", "disks.nvme0n1", "disks.sda"]);
        assert_eq!(diff.host_changed[1].after, Value::Null, "an absent field is null");
        assert_eq!(diff.host_changed[2].before["bytes"], 1u64 << 40);
        assert_eq!(diff.host_changed[3].before, Value::Null, "a new disk");
        // Backwards, the new disk is gone.
        let back = inventory_diff(&b, &a);
        assert_eq!(back.host_changed[3].after, Value::Null);
    }

    #[test]
    fn row_ids_sort_newest_first_and_name_their_sequence() {
        let node = "node_01J00000000000000000000000";
        let ids: Vec<String> = [1u64, 9, 10, 1000, u64::MAX].iter().map(|&s| inventory_row_id(node, s)).collect();
        let mut sorted = ids.clone();
        sorted.sort();
        sorted.reverse();
        assert_eq!(sorted, ids, "a later sequence sorts first");
        let prefix = inventory_row_prefix(node);
        assert!(ids.iter().all(|id| id.as_str() > prefix.as_str() && id.starts_with(&prefix)));
        assert_eq!(inventory_row_seq(node, &ids[2]), Some(10));
        assert_eq!(inventory_row_seq(node, &ids[4]), Some(u64::MAX));
        assert_eq!(inventory_row_seq("node_01J00000000000000000000001", &ids[2]), None, "another node's row");
        assert_eq!(inventory_row_seq(node, &format!("{prefix}12")), None);
    }
}
