//! `tunnels.open`: which action a tunnel is decided as, and whether it may open
//! ([`tunnel_open`]): the op against the target, the node's agent and what it advertises, and the
//! bounds on open tunnels; and, while it is open, whether its target has ended
//! ([`tunnel_target_ended`]). Pure: the gateway reads the documents, its live sessions and its
//! counts, and holds the ticket this grants; nothing is appended until the tunnel opens.

use bc_core::tunnel::{CAPABILITY_INSTANCE_DIAL, CAPABILITY_NODE_CONSOLE, Op};

use crate::instance::{DesiredState, InstanceDoc, InstanceState};
use crate::node::NodeDoc;
use crate::reservation::{ReservationDoc, ReservationState};

pub const ACTION_NODE_CONSOLE: &str = "compute:nodes:console";
pub const ACTION_INSTANCE_EXEC: &str = "compute:instances:exec";

/// What a tunnel reaches, as its document was read.
#[derive(Clone, Copy, Debug)]
pub enum TunnelTarget<'a> {
    /// A node, and whether it joined with `bcd` (`NodeDoc::agent`).
    Node { node_id: &'a str, has_agent: bool },
    /// An instance, the node it is on, and its state.
    Instance { instance_id: &'a str, node_id: &'a str, state: InstanceState },
}

/// The action `op` on a node (`on_node`) or an instance is decided as, before anything is read.
pub fn tunnel_action(on_node: bool) -> &'static str {
    if on_node { ACTION_NODE_CONSOLE } else { ACTION_INSTANCE_EXEC }
}

/// The tunnels open now that the new one would count against.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TunnelCounts {
    pub tenant: usize,
    pub key: usize,
    pub node: usize,
}

/// The bounds on open tunnels (`--tunnels-per-tenant-max`, `--tunnels-per-key-max`,
/// `--tunnels-per-node-max`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TunnelBounds {
    pub per_tenant_max: usize,
    pub per_key_max: usize,
    pub per_node_max: usize,
}

/// Everything [`tunnel_open`] decides on.
#[derive(Clone, Debug)]
pub struct TunnelOpenInput<'a> {
    pub op: Op,
    pub target: TunnelTarget<'a>,
    pub port: Option<u32>,
    /// What the node's agent advertised in its `Hello`; `None`: it has no session with this
    /// process.
    pub capabilities: Option<&'a [String]>,
    pub open: TunnelCounts,
    pub bounds: TunnelBounds,
}

/// What a granted tunnel is bound to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TunnelGrant {
    pub op: Op,
    pub node_id: String,
    pub instance_id: Option<String>,
    pub port: Option<u16>,
    /// `exec` in a sandbox: the command and its arguments (`decide::sandbox::sandbox_exec`).
    pub command: Vec<String>,
}

/// Which error a refusal is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TunnelRefusalKind {
    InvalidArgument,
    InvalidState,
    Unavailable,
    Unsupported,
    QuotaExceeded,
}

/// Why a tunnel may not open: the error, its message, and a stable `details.reason` for the
/// ones a client acts on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TunnelRefusal {
    pub kind: TunnelRefusalKind,
    pub message: String,
    pub reason: Option<&'static str>,
}

fn refuse(kind: TunnelRefusalKind, message: impl Into<String>, reason: Option<&'static str>) -> TunnelRefusal {
    TunnelRefusal { kind, message: message.into(), reason }
}

/// Decides `tunnels.open` (the caller has authorized [`tunnel_action`] already).
pub fn tunnel_open(input: &TunnelOpenInput<'_>) -> Result<TunnelGrant, TunnelRefusal> {
    use TunnelRefusalKind as K;
    let port = match (input.op, input.port) {
        (Op::Tcp, None) => return Err(refuse(K::InvalidArgument, "a tcp tunnel needs port (1 to 65535)", None)),
        (Op::Tcp, Some(port)) => match u16::try_from(port) {
            Ok(port) if port > 0 => Some(port),
            _ => return Err(refuse(K::InvalidArgument, format!("port {port} is not 1 to 65535"), None)),
        },
        (op, Some(_)) => return Err(refuse(K::InvalidArgument, format!("port is for tcp tunnels, not {}", op.as_str()), None)),
        (_, None) => None,
    };
    let (node_id, instance_id) = match input.target {
        TunnelTarget::Node { node_id, has_agent } => {
            if input.op != Op::Console {
                return Err(refuse(
                    K::InvalidArgument,
                    format!(
                        "a node takes console tunnels only, not {}; {} reaches an instance",
                        input.op.as_str(),
                        input.op.as_str()
                    ),
                    None,
                ));
            }
            if !has_agent {
                return Err(refuse(
                    K::InvalidState,
                    format!("node {node_id} did not join with bcd: no agent to attach a console"),
                    None,
                ));
            }
            (node_id.to_owned(), None)
        }
        TunnelTarget::Instance { instance_id, node_id, state } => {
            if input.op == Op::Exec {
                return Err(refuse(
                    K::Unsupported,
                    "bcd runs no command in a guest until guests have an agent; use console --instance for the serial console",
                    Some("guest-agent"),
                ));
            }
            if state != InstanceState::Running {
                return Err(refuse(K::InvalidState, format!("instance {instance_id} is {}, not running", state.as_str()), None));
            }
            (node_id.to_owned(), Some(instance_id.to_owned()))
        }
    };
    let Some(capabilities) = input.capabilities else {
        return Err(refuse(
            K::Unavailable,
            format!("node {node_id}'s agent has no session with this gateway now; try again when it is connected"),
            None,
        ));
    };
    // What the node's agent must advertise to attach the op's end.
    let (needed, cannot) = match instance_id {
        Some(_) => (CAPABILITY_INSTANCE_DIAL, "it cannot reach its instances"),
        None => (CAPABILITY_NODE_CONSOLE, "it cannot attach a console on its node"),
    };
    if !capabilities.iter().any(|c| c == needed) {
        return Err(refuse(
            K::Unsupported,
            format!("node {node_id}'s agent does not advertise {needed}: {cannot}"),
            Some("daemon-capability"),
        ));
    }
    let bounds = [
        (input.open.tenant, input.bounds.per_tenant_max, "tunnels-per-tenant", "the tenant"),
        (input.open.key, input.bounds.per_key_max, "tunnels-per-key", "this key"),
        (input.open.node, input.bounds.per_node_max, "tunnels-per-node", "the node"),
    ];
    for (open, max, reason, who) in bounds {
        if open >= max {
            return Err(refuse(K::QuotaExceeded, format!("{who} holds {open} open tunnels, the most it may"), Some(reason)));
        }
    }
    Ok(TunnelGrant { op: input.op, node_id, instance_id, port, command: Vec::new() })
}

/// An open tunnel's target as it is now, re-read while the tunnel lasts: `None` where no
/// document is (deleted).
#[derive(Clone, Copy, Debug)]
pub enum TunnelTargetNow<'a> {
    Node {
        node_id: &'a str,
        node: Option<&'a NodeDoc>,
    },
    /// An instance and the reservation holding its GPUs (`InstanceDoc::reservation_id`).
    Instance {
        instance_id: &'a str,
        instance: Option<&'a InstanceDoc>,
        reservation: Option<&'a ReservationDoc>,
    },
}

/// Why an open tunnel's target has ended (the tunnel then closes as `target-ended`), or `None`
/// while it may stay open: a node deleted or without its agent; an instance deleted, asked to
/// stop or be deleted, or stopped, failed or deleted; the reservation holding the instance
/// ended. A node's own reservations do not end a console on it: its owner opened that.
pub fn tunnel_target_ended(now: &TunnelTargetNow<'_>) -> Option<String> {
    match *now {
        TunnelTargetNow::Node { node_id, node } => match node {
            None => Some(format!("node {node_id} was deleted")),
            Some(doc) if doc.agent.is_none() => Some(format!("node {node_id} no longer has an agent")),
            Some(_) => None,
        },
        TunnelTargetNow::Instance { instance_id, instance, reservation } => {
            let Some(doc) = instance else { return Some(format!("instance {instance_id} was deleted")) };
            if doc.desired != DesiredState::Running {
                return Some(format!("instance {instance_id} is asked to be {}", doc.desired.as_str()));
            }
            if matches!(
                doc.state,
                InstanceState::Stopped | InstanceState::Deleting | InstanceState::Failed | InstanceState::Deleted
            ) {
                return Some(format!("instance {instance_id} is {}", doc.state.as_str()));
            }
            match reservation {
                None => Some(format!("the reservation {} holding instance {instance_id} is gone", doc.reservation_id)),
                Some(r) if r.state != ReservationState::Active => {
                    Some(format!("the reservation {} holding instance {instance_id} is {}", r.reservation_id, r.state.as_str()))
                }
                Some(_) => None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: TunnelBounds = TunnelBounds { per_tenant_max: 3, per_key_max: 2, per_node_max: 1 };
    const NODE: TunnelTarget<'static> = TunnelTarget::Node { node_id: "node_1", has_agent: true };
    const INSTANCE: TunnelTarget<'static> =
        TunnelTarget::Instance { instance_id: "inst_1", node_id: "node_1", state: InstanceState::Running };

    fn open(op: Op, target: TunnelTarget<'_>, port: Option<u32>, caps: Option<&[String]>) -> Result<TunnelGrant, TunnelRefusal> {
        tunnel_open(&TunnelOpenInput { op, target, port, capabilities: caps, open: TunnelCounts::default(), bounds: BOUNDS })
    }

    /// What an agent that attaches node consoles advertises.
    fn console_caps() -> [String; 1] {
        [CAPABILITY_NODE_CONSOLE.to_owned()]
    }

    #[test]
    fn a_console_on_a_node_with_a_session_is_granted() {
        let grant = open(Op::Console, NODE, None, Some(&console_caps())).unwrap();
        assert_eq!(
            grant,
            TunnelGrant { op: Op::Console, node_id: "node_1".into(), instance_id: None, port: None, command: Vec::new() }
        );
        assert_eq!(tunnel_action(true), "compute:nodes:console");
        assert_eq!(tunnel_action(false), "compute:instances:exec");
    }

    #[test]
    fn ops_targets_and_ports_are_checked() {
        let kind = |r: Result<TunnelGrant, TunnelRefusal>| r.unwrap_err().kind;
        assert_eq!(kind(open(Op::Tcp, NODE, Some(22), Some(&[]))), TunnelRefusalKind::InvalidArgument);
        assert_eq!(kind(open(Op::Console, NODE, Some(22), Some(&[]))), TunnelRefusalKind::InvalidArgument);
        let dial = [CAPABILITY_INSTANCE_DIAL.to_owned()];
        for port in [None, Some(0), Some(65_536)] {
            assert_eq!(kind(open(Op::Tcp, INSTANCE, port, Some(&dial))), TunnelRefusalKind::InvalidArgument, "{port:?}");
        }
        assert_eq!(open(Op::Tcp, INSTANCE, Some(5432), Some(&dial)).unwrap().port, Some(5432));
        let manual = TunnelTarget::Node { node_id: "node_2", has_agent: false };
        assert_eq!(kind(open(Op::Console, manual, None, Some(&console_caps()))), TunnelRefusalKind::InvalidState);
        let stopped = TunnelTarget::Instance { instance_id: "inst_1", node_id: "node_1", state: InstanceState::Stopped };
        assert_eq!(kind(open(Op::Console, stopped, None, Some(&dial))), TunnelRefusalKind::InvalidState);
    }

    #[test]
    fn instance_ops_need_the_capability_and_exec_is_refused() {
        let exec = open(Op::Exec, INSTANCE, None, Some(&[])).unwrap_err();
        assert_eq!((exec.kind, exec.reason), (TunnelRefusalKind::Unsupported, Some("guest-agent")));
        let console = open(Op::Console, INSTANCE, None, Some(&[])).unwrap_err();
        assert_eq!((console.kind, console.reason), (TunnelRefusalKind::Unsupported, Some("daemon-capability")));
        let gone = open(Op::Console, NODE, None, None).unwrap_err();
        assert_eq!(gone.kind, TunnelRefusalKind::Unavailable);
    }

    #[test]
    fn a_node_console_needs_its_agent_to_advertise_it() {
        for caps in [&[][..], &[CAPABILITY_INSTANCE_DIAL.to_owned()][..]] {
            let refused = open(Op::Console, NODE, None, Some(caps)).unwrap_err();
            assert_eq!((refused.kind, refused.reason), (TunnelRefusalKind::Unsupported, Some("daemon-capability")), "{caps:?}");
            assert!(refused.message.contains(CAPABILITY_NODE_CONSOLE), "{}", refused.message);
        }
        assert!(open(Op::Console, NODE, None, Some(&console_caps())).is_ok());
    }

    fn node_doc(agent: bool) -> NodeDoc {
        let mut doc: NodeDoc = serde_json::from_value(serde_json::json!({
            "tenantId": "ten_01", "nodeId": "node_1", "poolId": "pool_01", "name": "n1", "gpus": [],
            "labels": {}, "state": "ready", "version": 4, "createdAtMs": 0, "updatedAtMs": 0,
        }))
        .unwrap();
        doc.agent = agent.then(|| {
            serde_json::from_value(serde_json::json!({
                "publicKey": "", "agentVersion": "0", "hostname": "h", "joinTokenId": "jt_01", "joinedAtMs": 0,
                "reachable": true, "leaseExpiresAtMs": 0, "journalSeq": 0, "journalHash": "",
            }))
            .unwrap()
        });
        doc
    }

    fn instance_doc(desired: DesiredState, state: InstanceState) -> InstanceDoc {
        InstanceDoc {
            tenant_id: "ten_01".into(),
            instance_id: "inst_1".into(),
            name: "i1".into(),
            pool_id: "pool_01".into(),
            node_id: "node_1".into(),
            reservation_id: "rsv_1".into(),
            project_id: None,
            shape: crate::instance::InstanceShape { flavor_id: "flv_1".into(), vcpus: 1, memory_mib: 512, disk_gib: 1 },
            gpus: Vec::new(),
            image: crate::instance::InstanceImage {
                image_id: "img_1".into(),
                url: "https://example.com/i.qcow2".into(),
                sha256: String::new(),
                disk_format: crate::events::DiskFormat::Qcow2,
                size_bytes: None,
            },
            desired,
            generation: 1,
            state,
            observed: None,
            apply: crate::instance::ApplyStatus {
                command_id: String::new(),
                generation: 1,
                deadline_at_ms: 0,
                answered_at_ms: None,
                failed: None,
            },
            apply_attempts: 0,
            last_error: None,
            version: 1,
            created_at_ms: 0,
            updated_at_ms: 0,
        }
    }

    fn reservation_doc(state: ReservationState) -> ReservationDoc {
        let ask = crate::reservation::ReservationRequested {
            pool_id: "pool_01".into(),
            gpus: 1,
            duration_s: 60,
            selector: String::new(),
            nvlink: false,
            tolerations: Vec::new(),
            project_id: None,
        };
        ReservationDoc { state, ..ReservationDoc::requested("ten_01".into(), "rsv_1".into(), ask, 1, 0, 0) }
    }

    #[test]
    fn an_open_tunnel_ends_with_its_node_its_instance_or_the_instances_reservation() {
        let node = |doc: Option<&NodeDoc>| tunnel_target_ended(&TunnelTargetNow::Node { node_id: "node_1", node: doc });
        assert_eq!(node(Some(&node_doc(true))), None);
        assert!(node(None).unwrap().contains("node node_1 was deleted"));
        assert!(node(Some(&node_doc(false))).unwrap().contains("no longer has an agent"));

        let active = reservation_doc(ReservationState::Active);
        let instance = |doc: Option<&InstanceDoc>, reservation: Option<&ReservationDoc>| {
            tunnel_target_ended(&TunnelTargetNow::Instance { instance_id: "inst_1", instance: doc, reservation })
        };
        let running = instance_doc(DesiredState::Running, InstanceState::Running);
        assert_eq!(instance(Some(&running), Some(&active)), None);
        assert_eq!(instance(Some(&instance_doc(DesiredState::Running, InstanceState::Drifted)), Some(&active)), None);
        assert!(instance(None, Some(&active)).unwrap().contains("instance inst_1 was deleted"));
        let stopping = instance_doc(DesiredState::Stopped, InstanceState::Running);
        assert!(instance(Some(&stopping), Some(&active)).unwrap().contains("asked to be stopped"));
        for state in [InstanceState::Stopped, InstanceState::Deleting, InstanceState::Failed, InstanceState::Deleted] {
            let ended = instance(Some(&instance_doc(DesiredState::Running, state)), Some(&active)).unwrap();
            assert!(ended.contains(state.as_str()), "{ended}");
        }
        assert!(instance(Some(&running), None).unwrap().contains("rsv_1"));
        for state in [ReservationState::Released, ReservationState::Expired, ReservationState::Failed] {
            let ended = instance(Some(&running), Some(&reservation_doc(state))).unwrap();
            assert!(ended.contains("reservation rsv_1") && ended.contains(state.as_str()), "{ended}");
        }
    }

    #[test]
    fn each_bound_is_named_when_reached() {
        for (open_now, reason) in [
            (TunnelCounts { tenant: 3, key: 0, node: 0 }, "tunnels-per-tenant"),
            (TunnelCounts { tenant: 0, key: 2, node: 0 }, "tunnels-per-key"),
            (TunnelCounts { tenant: 0, key: 0, node: 1 }, "tunnels-per-node"),
        ] {
            let input = TunnelOpenInput {
                op: Op::Console,
                target: NODE,
                port: None,
                capabilities: Some(&console_caps()),
                open: open_now,
                bounds: BOUNDS,
            };
            let refusal = tunnel_open(&input).unwrap_err();
            assert_eq!((refusal.kind, refusal.reason), (TunnelRefusalKind::QuotaExceeded, Some(reason)));
        }
    }
}
