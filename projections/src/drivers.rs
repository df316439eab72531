//! `drivers.list`: the drivers a tenant's fleet has, read from what is already in the log. An
//! agent advertises each driver it runs as a capability in its last inventory (`hypervisor.<name>`,
//! `sandbox.<name>`: `bc_core::agent::driver_of_capability`); the control plane itself speaks
//! Redfish to every enrolled machine's BMC. Nothing is registered by hand, so the list is what the
//! fleet can do now, node by node.

use std::collections::BTreeMap;

use bc_core::agent::{DriverKind, driver_of_capability};
use serde::Serialize;

use crate::workflow::MetalDoc;
use crate::{NodeDoc, NodeState};

/// The BMC protocol the control plane speaks to enrolled machines.
pub const BMC_DRIVER_REDFISH: &str = "redfish";

/// One driver and where it is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DriverSeen {
    pub kind: DriverKind,
    pub name: String,
    /// Nodes whose agent advertises it (for a BMC protocol: machines enrolled with it).
    pub nodes: u64,
    /// Of those, the nodes `ready` now (for a BMC protocol: machines neither retired nor in
    /// maintenance).
    pub ready: u64,
    /// The pools they are in, sorted.
    pub pools: Vec<String>,
}

/// The drivers of `nodes` (each node's last inventory) and `machines`, sorted by kind and name.
pub fn drivers_of(nodes: &[NodeDoc], machines: &[MetalDoc]) -> Vec<DriverSeen> {
    let mut seen: BTreeMap<(DriverKind, String), DriverSeen> = BTreeMap::new();
    let mut count = |kind: DriverKind, name: &str, pool: &str, ready: bool| {
        let entry = seen.entry((kind, name.to_owned())).or_insert_with(|| DriverSeen {
            kind,
            name: name.to_owned(),
            nodes: 0,
            ready: 0,
            pools: Vec::new(),
        });
        entry.nodes += 1;
        entry.ready += u64::from(ready);
        if let Err(at) = entry.pools.binary_search_by(|p| p.as_str().cmp(pool)) {
            entry.pools.insert(at, pool.to_owned());
        }
    };
    for node in nodes {
        let capabilities = node.agent.as_ref().and_then(|a| a.inventory.as_ref()).map(|i| i.capabilities.as_slice());
        let mut named: Vec<(DriverKind, &str)> =
            capabilities.unwrap_or_default().iter().filter_map(|c| driver_of_capability(c)).collect();
        named.sort_unstable();
        named.dedup();
        for (kind, name) in named {
            count(kind, name, &node.pool_id, node.state == NodeState::Ready);
        }
    }
    for machine in machines {
        count(
            DriverKind::Bmc,
            BMC_DRIVER_REDFISH,
            &machine.pool_id,
            !machine.flags.retired && machine.flags.maintenance.is_none(),
        );
    }
    seen.into_values().collect()
}

/// A node of `pool` in `state` whose agent said `capabilities`, for tests of what is decided
/// from nodes' inventories (here and `decide::sandbox_volume`'s).
#[cfg(test)]
pub(crate) fn test_node(id: &str, pool: &str, state: NodeState, capabilities: &[&str]) -> NodeDoc {
    let mut doc: NodeDoc = serde_json::from_value(serde_json::json!({
        "tenantId": "t", "nodeId": id, "poolId": pool, "name": id, "gpus": [], "labels": {},
        "state": "ready", "version": 1, "createdAtMs": 0, "updatedAtMs": 0,
        "agent": {
            "publicKey": "", "agentVersion": "0", "hostname": id, "joinTokenId": "", "joinedAtMs": 0,
            "reachable": true, "leaseExpiresAtMs": 0, "journalSeq": 0, "journalHash": ""
        }
    }))
    .unwrap_or_else(|e| panic!("a node document: {e}"));
    doc.state = state;
    let inventory: crate::inventory::NodeInventoryReported = serde_json::from_value(serde_json::json!({
        "nodeId": id, "gpus": [], "host": { "cpus": 1, "memoryKiB": 1, "disks": [] }, "capabilities": capabilities
    }))
    .unwrap_or_else(|e| panic!("an inventory: {e}"));
    if let Some(agent) = doc.agent.as_mut() {
        agent.inventory = Some(inventory);
    }
    doc
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::test_node as node;

    #[test]
    fn each_driver_is_counted_once_a_node_with_its_pools() {
        let nodes = [
            node("n1", "pool_b", NodeState::Ready, &["gpu.hold", "hypervisor.libvirt", "sandbox.gvisor", "hypervisor.libvirt"]),
            node("n2", "pool_a", NodeState::Unreachable, &["hypervisor.libvirt"]),
            node("n3", "pool_a", NodeState::Ready, &["hypervisor.fake", "tunnel.node-console"]),
        ];
        let seen = drivers_of(&nodes, &[]);
        let brief: Vec<(&str, &str, u64, u64, Vec<&str>)> = seen
            .iter()
            .map(|d| (d.kind.as_str(), d.name.as_str(), d.nodes, d.ready, d.pools.iter().map(String::as_str).collect()))
            .collect();
        assert_eq!(
            brief,
            vec![
                ("hypervisor", "fake", 1, 1, vec!["pool_a"]),
                ("hypervisor", "libvirt", 2, 1, vec!["pool_a", "pool_b"]),
                ("sandbox-runtime", "gvisor", 1, 1, vec!["pool_b"]),
            ]
        );
        assert!(drivers_of(&[], &[]).is_empty());
    }
}
