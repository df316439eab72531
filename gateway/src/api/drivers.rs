//! `drivers.list`: the hypervisors, sandbox runtimes and BMC protocols a tenant's fleet has,
//! read from its nodes' last inventories and its enrolled machines (`bc_projections::drivers`).
//! Decided as `compute:nodes:read`: it says no more than the nodes and machines it counts.

use bc_core::Result;
use bc_core::agent::DriverKind;
use bc_projections::drivers::{DriverSeen, drivers_of};
use bc_projections::workflow::{KIND_METAL, MetalDoc};
use bc_projections::{KIND_NODE, NodeDoc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::validate::{PoolIdText, TenantIdText};
use super::{Access, Call, Method, method};

/// Every node and machine of the tenant is read (at most `NODES_PER_TENANT_MAX` of each).
const READ: Access = Access::Action("compute:nodes:read");

pub(super) const METHODS: &[Method] = &[method!(
    "drivers.list",
    READ,
    "the hypervisors, sandbox runtimes and BMC protocols of the tenant's fleet: what its agents advertise and how its machines are managed",
    DriversList => DriversView,
    drivers_list,
)];

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DriversList {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DriversView {
    /// Sorted by kind, then name; empty for a fleet with no agent and no machine.
    pub items: Vec<DriverView>,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DriverView {
    pub kind: DriverKindView,
    /// `libvirt`, `fake` (a fake machine's hypervisor), `gvisor`, `redfish`.
    pub name: String,
    /// Nodes whose agent advertises it in its last inventory (a BMC protocol: machines enrolled).
    pub nodes: u64,
    /// Of those, the nodes ready now (a BMC protocol: machines neither retired nor in maintenance).
    pub ready: u64,
    #[schemars(with = "Vec<PoolIdText>")]
    pub pools: Vec<String>,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum DriverKindView {
    Hypervisor,
    SandboxRuntime,
    Bmc,
}

impl From<DriverSeen> for DriverView {
    fn from(d: DriverSeen) -> Self {
        let kind = match d.kind {
            DriverKind::Hypervisor => DriverKindView::Hypervisor,
            DriverKind::SandboxRuntime => DriverKindView::SandboxRuntime,
            DriverKind::Bmc => DriverKindView::Bmc,
        };
        Self { kind, name: d.name, nodes: d.nodes, ready: d.ready, pools: d.pools }
    }
}

async fn drivers_list(call: &Call<'_>, input: DriversList) -> Result<DriversView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let store = &*call.state.store;
    let nodes: Vec<NodeDoc> = bc_projections::placement::all_rows(store, tenant, KIND_NODE).await?;
    let machines: Vec<MetalDoc> = bc_projections::placement::all_rows(store, tenant, KIND_METAL).await?;
    Ok(DriversView { items: drivers_of(&nodes, &machines).into_iter().map(DriverView::from).collect() })
}
