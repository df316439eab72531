//! The node's ledger of the GPUs it holds, by reservation (`holds.json` in the data directory,
//! written whole to a temporary file and renamed, 0600), and the pure decisions over it: whether
//! a `gpu.hold` may go ahead ([`decide_hold`]), and what a `gpu.release` gives back.
//!
//! The ledger is what makes a hold safe to run twice and a GPU impossible to hold for two
//! reservations: a hold for a reservation already in it is answered `gpu.held` again without
//! touching the machine (a redelivery after a crash between binding and journaling), and a GPU
//! held for one reservation is refused to any other (`gpu-held`) until released. It is written
//! after the binding and before the journal entry that reports it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::binding::{HeldGpu, pci_address};
use crate::inventory::Inventory;

/// Reservations one node holds GPUs for at most (a node has at most 64 GPUs).
pub const HOLDS_MAX: usize = 64;

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Hold {
    pub command_id: String,
    pub gpus: Vec<HeldGpu>,
    /// A `gpu.release` the machine refused: the GPUs stay held (no other reservation gets
    /// them) and the agent retries the release until it succeeds, then reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release_command_id: Option<String>,
}

/// Reservation id → what this node holds for it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ledger {
    pub holds: BTreeMap<String, Hold>,
}

/// What a `gpu.hold` asks: the reservation and its GPUs' UUIDs.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HoldArgs {
    pub reservation_id: String,
    #[serde(default)]
    pub gpu_uuids: Vec<String>,
}

/// What to do about a `gpu.hold`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HoldDecision {
    /// Already held for this reservation: report it again, touch nothing.
    AlreadyHeld(Vec<HeldGpu>),
    /// Bind these, then record them.
    Bind(Vec<HeldGpu>),
    /// Refuse, with the reason (a stable code, a colon, and words).
    Refuse(String),
}

/// Whether a hold may go ahead: every GPU named is on this machine (by UUID, in `inventory`,
/// with a PCI address) and held for no other reservation.
pub fn decide_hold(ledger: &Ledger, inventory: &Inventory, args: &HoldArgs) -> HoldDecision {
    if let Some(hold) = ledger.holds.get(&args.reservation_id) {
        // The same hold again (a redelivery): answered, not redone. Other GPUs for it, or a
        // release of it still pending: refused until the node has given the old ones back.
        let same = hold.gpus.iter().map(|g| g.uuid.as_str()).eq(args.gpu_uuids.iter().map(String::as_str));
        if same && hold.release_command_id.is_none() {
            return HoldDecision::AlreadyHeld(hold.gpus.clone());
        }
        return HoldDecision::Refuse(format!(
            "gpu-held: {} is still held here with other GPUs or a release pending",
            args.reservation_id
        ));
    }
    if args.gpu_uuids.is_empty() {
        return HoldDecision::Refuse("gpu-missing: the hold names no GPU".into());
    }
    if ledger.holds.len() >= HOLDS_MAX {
        return HoldDecision::Refuse(format!("node-full: this node holds GPUs for {HOLDS_MAX} reservations"));
    }
    let mut gpus = Vec::new();
    for uuid in &args.gpu_uuids {
        if let Some((other, _)) = ledger.holds.iter().find(|(_, h)| h.gpus.iter().any(|g| g.uuid == *uuid)) {
            return HoldDecision::Refuse(format!("gpu-held: {uuid} is held for {other}"));
        }
        if gpus.iter().any(|g: &HeldGpu| g.uuid == *uuid) {
            return HoldDecision::Refuse(format!("gpu-missing: {uuid} is named twice"));
        }
        let Some(info) = inventory.gpus.gpus.iter().find(|g| g.uuid == *uuid) else {
            return HoldDecision::Refuse(format!("gpu-missing: {uuid} is not on this machine"));
        };
        let Some(address) = pci_address(&info.pci_bus_id) else {
            return HoldDecision::Refuse(format!("gpu-missing: {uuid} has no PCI address ({:?})", info.pci_bus_id));
        };
        gpus.push(HeldGpu { uuid: uuid.clone(), pci_address: address });
    }
    HoldDecision::Bind(gpus)
}

impl crate::ledger::LedgerContents for Ledger {
    const FILE: &'static str = "holds.json";
}

/// The ledger on disk (`holds.json`).
pub type LedgerFile = crate::ledger::LedgerFile<Ledger>;

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::inventory::{GpuInfo, GpuInventory};

    /// A machine of `n` H100s, `GPU-0`… at PCI `00000000:10:00.0`….
    pub(crate) fn inventory_of(n: u32) -> Inventory {
        let gpu = |i: u32| GpuInfo {
            index: i,
            uuid: format!("GPU-{i}"),
            model: "H100".into(),
            product: "H100".into(),
            vram_gib: 80,
            pci_bus_id: format!("00000000:{:02X}:00.0", 0x10 + i),
            nvlink_domain: 0,
        };
        Inventory { gpus: GpuInventory { gpus: (0..n).map(gpu).collect(), ..Default::default() }, ..Default::default() }
    }

    fn inventory() -> Inventory {
        inventory_of(4)
    }

    fn args(rsv: &str, uuids: &[&str]) -> HoldArgs {
        HoldArgs { reservation_id: rsv.into(), gpu_uuids: uuids.iter().map(|u| (*u).to_owned()).collect() }
    }

    #[test]
    fn a_gpu_is_held_for_one_reservation_at_a_time() {
        let mut ledger = Ledger::default();
        let HoldDecision::Bind(gpus) = decide_hold(&ledger, &inventory(), &args("rsv_a", &["GPU-0", "GPU-1"])) else {
            panic!("binds")
        };
        assert_eq!(gpus[1].pci_address, "0000:11:00.0");
        ledger.holds.insert("rsv_a".into(), Hold { command_id: "cmd_1".into(), gpus: gpus.clone(), release_command_id: None });
        assert_eq!(decide_hold(&ledger, &inventory(), &args("rsv_a", &["GPU-0", "GPU-1"])), HoldDecision::AlreadyHeld(gpus));
        // The same reservation with other GPUs (placed again elsewhere on the node) waits.
        assert!(
            matches!(decide_hold(&ledger, &inventory(), &args("rsv_a", &["GPU-2"])), HoldDecision::Refuse(r) if r.starts_with("gpu-held:"))
        );
        let refused = decide_hold(&ledger, &inventory(), &args("rsv_b", &["GPU-2", "GPU-1"]));
        assert_eq!(refused, HoldDecision::Refuse("gpu-held: GPU-1 is held for rsv_a".into()));
        assert!(matches!(decide_hold(&ledger, &inventory(), &args("rsv_b", &["GPU-2", "GPU-3"])), HoldDecision::Bind(_)));
        assert!(
            matches!(decide_hold(&ledger, &inventory(), &args("rsv_b", &["GPU-9"])), HoldDecision::Refuse(r) if r.starts_with("gpu-missing:"))
        );
        assert!(matches!(decide_hold(&ledger, &inventory(), &args("rsv_b", &["GPU-2", "GPU-2"])), HoldDecision::Refuse(_)));
    }

    #[test]
    fn the_ledger_survives_a_restart_and_is_private() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let file = LedgerFile::new(dir.path());
        assert_eq!(file.load().unwrap(), Ledger::default());
        let mut ledger = Ledger::default();
        ledger.holds.insert("rsv_a".into(), Hold { command_id: "cmd_1".into(), gpus: vec![], release_command_id: None });
        file.save(&ledger).unwrap();
        assert_eq!(LedgerFile::new(dir.path()).load().unwrap(), ledger);
        let mode = std::fs::metadata(dir.path().join("holds.json")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}
