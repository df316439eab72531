//! `tunnels.open`: which action a tunnel is decided as, and whether it may open
//! ([`tunnel_open`]): the op against the target, the node's agent and what it advertises, and the
//! bounds on open tunnels. Pure: the gateway reads the documents, its live sessions and its
//! counts, and holds the ticket this grants; nothing is appended until the tunnel opens.

use bc_core::tunnel::{CAPABILITY_INSTANCE_DIAL, CAPABILITY_NODE_CONSOLE, Op};

use crate::instance::InstanceState;

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
    Ok(TunnelGrant { op: input.op, node_id, instance_id, port })
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
        assert_eq!(grant, TunnelGrant { op: Op::Console, node_id: "node_1".into(), instance_id: None, port: None });
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
