//! Placement: the selector language and the choice of GPUs for a reservation. Pure functions of
//! node documents, so the gateway (placing at once), the reconciler (placing queued requests),
//! `capacity.preview` and the property tests all decide the same way.
//!
//! **Selectors** are comma-separated clauses, all of which must hold for a GPU:
//! `ATTR OP VALUE` with `OP` one of `=` `==` `!=` `>` `>=` `<` `<=`, or `ATTR in (V, …)` /
//! `ATTR notin (V, …)`. Attributes: `gpuModel`, `gpuProduct`, `vramGiB`, `nvlinkDomain` (the
//! GPU's), `node` (the node id), `nodeName`, `label.KEY` (the node's labels). Order comparisons
//! need a number on both sides. Values are bare words (`H100-SXM5-80GB`) or double-quoted.
//! Errors name the column (1-based) where the text stops making sense.
//!
//! **Placement** looks at usable nodes (state `ready`, every taint tolerated), at their free
//! GPUs that match the selector, and takes all of a request's GPUs from one node, and from one
//! NVLink domain when asked. Among the nodes that fit it takes the tightest: the one where the
//! fewest matching GPUs stay free after it (then the lowest node id), and inside a node the
//! smallest domain that fits, so large requests still find whole nodes and domains.

use std::collections::BTreeMap;

use bc_core::{Error, Result};

use bc_core::id::TenantId;
use bc_core::store::{EventStore, ExpectedVersion, NewEvent};

use crate::events::{
    COMMAND_ISSUED, CommandIssued, HoldIssued, NODE_ALLOCATED, NODE_FREED, NodeAllocated, NodeFreed, RESERVATION_ACTIVATED,
    RESERVATION_EXPIRED, RESERVATION_FAILED, RESERVATION_RELEASED, RESERVATION_REQUEUED, ReservationActivated, ReservationEnded,
    ReservationFailed, ReservationRequeued, to_cbor,
};
use crate::{KIND_NODE, KIND_RESERVATION_LIVE, NodeDoc, ReservationDoc, stream_of};

pub const SELECTOR_BYTES_MAX: usize = 512;
pub const SELECTOR_CLAUSES_MAX: usize = 16;
pub const SELECTOR_VALUES_MAX: usize = 32;
/// GPUs one reservation may ask for (a node's worth at most).
pub const RESERVATION_GPUS_MAX: u32 = 64;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Attr {
    GpuModel,
    GpuProduct,
    VramGib,
    NvlinkDomain,
    Node,
    NodeName,
    Label(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Eq,
    Ne,
    Gt,
    Ge,
    Lt,
    Le,
    In,
    NotIn,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Clause {
    pub attr: Attr,
    pub op: Op,
    pub values: Vec<String>,
    /// The values as numbers, for the numeric attributes (parsed once, not per GPU).
    pub numbers: Vec<u64>,
}

/// A parsed selector; empty matches every GPU.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selector {
    pub clauses: Vec<Clause>,
}

fn at(column: usize, message: impl std::fmt::Display) -> Error {
    Error::InvalidArgument {
        message: format!("selector, column {}: {message}", column + 1),
        hint: Some(
            "clauses like gpuProduct in (H100-SXM5-80GB), vramGiB >= 80, label.rack = r1; attributes: gpuModel, gpuProduct, vramGiB, nvlinkDomain, node, nodeName, label.KEY".into(),
        ),
    }
}

struct Lexer<'a> {
    text: &'a str,
    pos: usize,
}

impl<'a> Lexer<'a> {
    fn skip_spaces(&mut self) {
        while self.text[self.pos..].starts_with([' ', '\t']) {
            self.pos += 1;
        }
    }

    fn peek(&mut self) -> Option<char> {
        self.skip_spaces();
        self.text[self.pos..].chars().next()
    }

    fn word(&mut self) -> Option<&'a str> {
        self.skip_spaces();
        let rest = &self.text[self.pos..];
        let len = rest.find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/'))).unwrap_or(rest.len());
        if len == 0 {
            return None;
        }
        self.pos += len;
        Some(&rest[..len])
    }

    /// A value and the column where it starts.
    fn value(&mut self) -> Result<(usize, String)> {
        self.skip_spaces();
        let start = self.pos;
        self.value_text().map(|v| (start, v))
    }

    fn value_text(&mut self) -> Result<String> {
        if self.text[self.pos..].starts_with('"') {
            let start = self.pos;
            let rest = &self.text[self.pos + 1..];
            let end = rest.find('"').ok_or_else(|| at(start, "unterminated quoted value"))?;
            self.pos += end + 2;
            return Ok(rest[..end].to_owned());
        }
        let start = self.pos;
        self.word().map(str::to_owned).ok_or_else(|| at(start, "expected a value"))
    }

    fn op(&mut self) -> Result<Op> {
        self.skip_spaces();
        let start = self.pos;
        let rest = &self.text[self.pos..];
        for (text, op) in
            [("==", Op::Eq), ("!=", Op::Ne), (">=", Op::Ge), ("<=", Op::Le), ("=", Op::Eq), (">", Op::Gt), ("<", Op::Lt)]
        {
            if rest.starts_with(text) {
                self.pos += text.len();
                return Ok(op);
            }
        }
        match self.word() {
            Some("in") => Ok(Op::In),
            Some("notin") => Ok(Op::NotIn),
            _ => Err(at(start, "expected an operator: = != > >= < <= in notin")),
        }
    }
}

impl Selector {
    pub fn parse(text: &str) -> Result<Self> {
        if text.len() > SELECTOR_BYTES_MAX {
            return Err(Error::invalid(format!("a selector is at most {SELECTOR_BYTES_MAX} bytes")));
        }
        if let Some((i, _)) = text.char_indices().find(|(_, c)| c.is_control() && *c != '\t') {
            return Err(at(i, "control character"));
        }
        // ASCII only, so a byte offset is the column a person counts.
        if let Some((i, c)) = text.char_indices().find(|(_, c)| !c.is_ascii()) {
            return Err(at(text[..i].chars().count(), format!("{c:?} is not ASCII")));
        }
        let mut lexer = Lexer { text, pos: 0 };
        let mut clauses = Vec::new();
        if lexer.peek().is_none() {
            return Ok(Self { clauses });
        }
        loop {
            lexer.skip_spaces();
            let start = lexer.pos;
            let name = lexer.word().ok_or_else(|| at(start, "expected an attribute"))?;
            let attr = match name {
                "gpuModel" => Attr::GpuModel,
                "gpuProduct" => Attr::GpuProduct,
                "vramGiB" => Attr::VramGib,
                "nvlinkDomain" => Attr::NvlinkDomain,
                "node" => Attr::Node,
                "nodeName" => Attr::NodeName,
                other => match other.strip_prefix("label.") {
                    Some(key) if !key.is_empty() => Attr::Label(key.to_owned()),
                    _ => return Err(at(start, format!("unknown attribute {other:?}"))),
                },
            };
            lexer.skip_spaces();
            let op_at = lexer.pos;
            let op = lexer.op()?;
            let values = if matches!(op, Op::In | Op::NotIn) {
                if lexer.peek() != Some('(') {
                    return Err(at(lexer.pos, "expected ( after in"));
                }
                lexer.pos += 1;
                let mut values = vec![lexer.value()?];
                loop {
                    match lexer.peek() {
                        Some(',') => {
                            lexer.pos += 1;
                            values.push(lexer.value()?);
                        }
                        Some(')') => {
                            lexer.pos += 1;
                            break;
                        }
                        _ => return Err(at(lexer.pos, "expected , or ) in the value list")),
                    }
                }
                if values.len() > SELECTOR_VALUES_MAX {
                    return Err(at(op_at, format!("at most {SELECTOR_VALUES_MAX} values in a list")));
                }
                values
            } else {
                vec![lexer.value()?]
            };
            let numeric = matches!(attr, Attr::VramGib | Attr::NvlinkDomain);
            if matches!(op, Op::Gt | Op::Ge | Op::Lt | Op::Le) && !numeric {
                return Err(at(op_at, format!("{name} is text: it cannot be ordered, only compared with = != in notin")));
            }
            if numeric && let Some((col, bad)) = values.iter().find(|(_, v)| v.parse::<u64>().is_err()) {
                return Err(at(*col, format!("{name} is a number, not {bad:?}")));
            }
            let numbers = if numeric { values.iter().filter_map(|(_, v)| v.parse().ok()).collect() } else { Vec::new() };
            clauses.push(Clause { attr, op, values: values.into_iter().map(|(_, v)| v).collect(), numbers });
            if clauses.len() > SELECTOR_CLAUSES_MAX {
                return Err(at(start, format!("at most {SELECTOR_CLAUSES_MAX} clauses")));
            }
            match lexer.peek() {
                None => break,
                Some(',') => lexer.pos += 1,
                Some(_) => return Err(at(lexer.pos, "expected , between clauses")),
            }
        }
        Ok(Self { clauses })
    }

    /// Adds `gpuModel = M` / `gpuProduct = P` clauses (the CLI's --model and --product).
    pub fn and_equals(mut self, attr: Attr, value: &str) -> Self {
        self.clauses.push(Clause { attr, op: Op::Eq, values: vec![value.to_owned()], numbers: Vec::new() });
        self
    }

    /// Whether GPU `index` of `node` matches.
    pub fn matches(&self, node: &NodeDoc, index: usize) -> bool {
        let gpu = &node.gpus[index];
        self.clauses.iter().all(|clause| {
            let number = match clause.attr {
                Attr::VramGib => Some(u64::from(gpu.vram_gib)),
                Attr::NvlinkDomain => Some(u64::from(gpu.nvlink_domain)),
                _ => None,
            };
            if let Some(n) = number {
                let b = clause.numbers.first().copied().unwrap_or(0);
                return match clause.op {
                    Op::Eq => n == b,
                    Op::Ne => n != b,
                    Op::In => clause.numbers.contains(&n),
                    Op::NotIn => !clause.numbers.contains(&n),
                    Op::Gt => n > b,
                    Op::Ge => n >= b,
                    Op::Lt => n < b,
                    Op::Le => n <= b,
                };
            }
            let actual: Option<&str> = match &clause.attr {
                Attr::GpuModel => Some(&gpu.model),
                Attr::GpuProduct => Some(&gpu.product),
                Attr::Node => Some(&node.node_id),
                Attr::NodeName => Some(&node.name),
                Attr::Label(key) => node.labels.get(key).map(String::as_str),
                Attr::VramGib | Attr::NvlinkDomain => None,
            };
            let eq = |v: &String| actual == Some(v.as_str());
            match clause.op {
                Op::Eq => eq(&clause.values[0]),
                Op::Ne => !eq(&clause.values[0]),
                Op::In => clause.values.iter().any(eq),
                Op::NotIn => !clause.values.iter().any(eq),
                // Refused by the parser: text is never ordered.
                Op::Gt | Op::Ge | Op::Lt | Op::Le => false,
            }
        })
    }
}

/// What a reservation asks of placement.
#[derive(Clone, Debug)]
pub struct Ask<'a> {
    pub gpus: u32,
    pub selector: &'a Selector,
    pub nvlink: bool,
    pub tolerations: &'a [String],
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    pub node_id: String,
    /// The node's version the decision read: the append guards it, so a decision made on a
    /// node that changed meanwhile is a CONFLICT, never a double booking.
    pub node_version: u64,
    pub gpus: Vec<u32>,
    /// Matching GPUs of the node still free after this placement.
    pub leftover: u32,
    /// On a node with an agent, the placed GPUs' UUIDs: the activation sends it `gpu.hold` for
    /// them. `None` for a node registered by hand, whose GPUs are bound at once.
    pub hold: Option<Vec<String>>,
}

/// A command an append issues as part of a decision: its id, drawn by the caller, and the
/// decision's time (the command's deadline counts from it).
#[derive(Clone, Copy, Debug)]
pub struct Issue<'a> {
    pub command_id: &'a str,
    pub now_ms: u64,
}

/// The kinds of the commands the control plane issues for reservations.
pub const GPU_HOLD: &str = "gpu.hold";
pub const GPU_RELEASE: &str = "gpu.release";

/// `command.issued` for `node_id` on the command's own stream, and what the reservation records
/// of it.
/// The command's stream is new: the append guards it as such (an event on another stream must be
/// guarded).
pub(crate) fn issue_command(
    node_id: &str,
    kind: &str,
    args: serde_json::Value,
    issue: Issue<'_>,
    guards: &mut Vec<(String, ExpectedVersion)>,
) -> Result<(NewEvent, HoldIssued)> {
    let deadline_s = if kind == crate::INSTANCE_APPLY { crate::INSTANCE_APPLY_DEADLINE_S } else { crate::HOLD_DEADLINE_S };
    issue_command_for(node_id, kind, args, deadline_s, issue, guards)
}

/// [`issue_command`] with the command's deadline given.
pub(crate) fn issue_command_for(
    node_id: &str,
    kind: &str,
    args: serde_json::Value,
    deadline_s: u64,
    issue: Issue<'_>,
    guards: &mut Vec<(String, ExpectedVersion)>,
) -> Result<(NewEvent, HoldIssued)> {
    let deadline_at_ms = issue.now_ms.saturating_add(deadline_s * 1000);
    let stream = stream_of(crate::KIND_COMMAND, &issue.command_id);
    guards.push((stream.clone(), ExpectedVersion::NoStream));
    let event = NewEvent {
        stream: Some(stream),
        event_type: COMMAND_ISSUED.into(),
        payload: to_cbor(&CommandIssued {
            node_id: node_id.to_owned(),
            kind: kind.to_owned(),
            args,
            deadline_at_ms,
            release: None,
        })?,
    };
    Ok((event, HoldIssued { command_id: issue.command_id.to_owned(), deadline_at_ms }))
}

/// Whether a node may take new reservations for this ask at all.
pub fn usable(node: &NodeDoc, tolerations: &[String]) -> bool {
    // A node whose agent says it cannot hold GPUs (`holdUnavailable`: no vfio-pci, not root)
    // would only fail each hold sent to it: it takes none, like a cordoned node.
    let cannot_hold = node.agent.as_ref().and_then(|a| a.inventory.as_ref()).is_some_and(|i| i.hold_unavailable.is_some());
    node.state == crate::NodeState::Ready && !cannot_hold && node.taints.keys().all(|k| tolerations.iter().any(|t| t == k))
}

/// The best GPUs on one node, or `None` if it cannot take the ask.
pub fn fit(node: &NodeDoc, ask: &Ask<'_>) -> Option<Placement> {
    if ask.gpus == 0 || !usable(node, ask.tolerations) {
        return None;
    }
    // Free, matching GPUs by NVLink domain, in index order.
    let mut domains: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    let mut free = 0u32;
    for (i, gpu) in node.gpus.iter().enumerate() {
        let i = i as u32;
        if !node.allocations.contains_key(&i) && ask.selector.matches(node, i as usize) {
            domains.entry(gpu.nvlink_domain).or_default().push(i);
            free += 1;
        }
    }
    if free < ask.gpus {
        return None;
    }
    let need = ask.gpus as usize;
    // Smallest domains first (then lowest domain number): a request takes the tightest domain
    // that holds it whole, and otherwise fills small domains before breaking into big ones.
    let mut order: Vec<(&u32, &Vec<u32>)> = domains.iter().collect();
    order.sort_by_key(|(domain, list)| (list.len(), **domain));
    let gpus: Vec<u32> = if ask.nvlink {
        let (_, list) = order.iter().find(|(_, list)| list.len() >= need)?;
        list[..need].to_vec()
    } else if let Some((_, list)) = order.iter().find(|(_, list)| list.len() >= need) {
        list[..need].to_vec()
    } else {
        order.iter().flat_map(|(_, list)| list.iter().copied()).take(need).collect()
    };
    let mut gpus = gpus;
    gpus.sort_unstable();
    // A node with an agent names its GPUs by UUID (from its inventory; a GPU it never reported
    // a UUID for is named by an empty one, which the node refuses to hold).
    let hold =
        node.agent.as_ref().map(|_| gpus.iter().map(|&i| node.gpu_uuids.get(i as usize).cloned().unwrap_or_default()).collect());
    Some(Placement { node_id: node.node_id.clone(), node_version: node.version, gpus, leftover: free - ask.gpus, hold })
}

/// How many matching GPUs would stay free on `node` after the ask, or `None` if it cannot take
/// it: [`fit`]'s `leftover`, without building the placement (no allocation), since placement
/// scores every node of a pool.
pub fn leftover(node: &NodeDoc, ask: &Ask<'_>) -> Option<u32> {
    if node.gpus.len() < ask.gpus as usize + node.allocations.len() || !usable(node, ask.tolerations) {
        return None;
    }
    score(node, ask, true)
}

/// Whether the ask could ever fit on `node`: with every GPU free, whatever its state and taints
/// (which an operator may change). A request no node could ever take would block its pool's
/// queue for good, so it is refused instead.
pub fn could_fit(node: &NodeDoc, ask: &Ask<'_>) -> bool {
    score(node, ask, false).is_some()
}

fn score(node: &NodeDoc, ask: &Ask<'_>, honour_holds: bool) -> Option<u32> {
    let need = ask.gpus as usize;
    if need == 0 {
        return None;
    }
    // (domain, free matching GPUs in it); a node has at most GPUS_PER_NODE_MAX GPUs.
    const DOMAINS_MAX: usize = 64;
    let mut domains = [(0u32, 0u32); DOMAINS_MAX];
    let mut used = 0usize;
    let mut free = 0u32;
    for (i, gpu) in node.gpus.iter().enumerate() {
        if (honour_holds && node.allocations.contains_key(&(i as u32))) || !ask.selector.matches(node, i) {
            continue;
        }
        free += 1;
        if ask.nvlink {
            match domains[..used].iter().position(|(d, _)| *d == gpu.nvlink_domain) {
                Some(at) => domains[at].1 += 1,
                None if used < DOMAINS_MAX => {
                    domains[used] = (gpu.nvlink_domain, 1);
                    used += 1;
                }
                None => return None,
            }
        }
    }
    if (free as usize) < need || (ask.nvlink && !domains[..used].iter().any(|(_, n)| *n as usize >= need)) {
        return None;
    }
    Some(free - ask.gpus)
}

/// The tightest fit among `nodes`: fewest matching GPUs left free, then the lowest node id.
pub fn place<'n>(nodes: impl IntoIterator<Item = &'n NodeDoc>, ask: &Ask<'_>) -> Option<Placement> {
    place_by(nodes, ask, Preference::TightestFit)
}

/// A node's free GPUs: those no reservation holds, whatever they are.
pub fn free_gpus(node: &NodeDoc) -> u32 {
    (0..node.gpus.len() as u32).filter(|i| !node.allocations.contains_key(i)).count() as u32
}

/// [`place_by`] over nodes given with their [`free_gpus`] in ascending order of (free GPUs,
/// node id), as [`crate::fleet::FleetIndex::ranked`] keeps them: the same choice, without
/// scoring every node. The matching GPUs left on a node are at most its free GPUs less the ask,
/// and exactly that when the selector is empty (every GPU matches), so a tightest fit with no
/// selector takes the first node that fits, and spread walks down from the freest node until
/// no node left could beat the one it has (all the nodes as free as the best, for the lowest
/// id). A tightest fit with a selector scores every node with enough free GPUs (one with more
/// free GPUs may have fewer matching).
pub fn place_ranked<'n>(
    ranked: impl DoubleEndedIterator<Item = (u32, &'n NodeDoc)>,
    ask: &Ask<'_>,
    preference: Preference,
) -> Option<Placement> {
    let exact = ask.selector.clauses.is_empty();
    let mut best: Option<(u32, &NodeDoc)> = None;
    let consider = |best: &mut Option<(u32, &'n NodeDoc)>, node: &'n NodeDoc| {
        if let Some(left) = leftover(node, ask)
            && best.is_none_or(|(l, b)| better(preference, left, node, l, b))
        {
            *best = Some((left, node));
        }
    };
    match preference {
        Preference::TightestFit => {
            for (_, node) in ranked.skip_while(|(free, _)| *free < ask.gpus) {
                consider(&mut best, node);
                // With no selector the nodes come in the order of the choice: the first that
                // fits has the fewest left, then the lowest id.
                if exact && best.is_some() {
                    break;
                }
            }
        }
        Preference::Spread => {
            for (free, node) in ranked.rev() {
                if free < ask.gpus || best.is_some_and(|(l, _)| free - ask.gpus < l) {
                    break;
                }
                consider(&mut best, node);
            }
        }
    }
    best.and_then(|(_, node)| fit(node, ask))
}

/// Whether `preference` takes `node` with `left` matching GPUs left over `best` with
/// `best_left` (ties: the lower node id).
fn better(preference: Preference, left: u32, node: &NodeDoc, best_left: u32, best: &NodeDoc) -> bool {
    match preference {
        Preference::TightestFit => (left, &node.node_id) < (best_left, &best.node_id),
        Preference::Spread => left > best_left || (left == best_left && node.node_id < best.node_id),
    }
}

/// Which node a placement prefers among those that fit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Preference {
    /// Fewest matching GPUs left free (what this control plane does): large requests keep
    /// finding whole nodes.
    #[default]
    TightestFit,
    /// Most matching GPUs left free: load spread over the nodes (a what-if of `sim replay`).
    Spread,
}

impl Preference {
    pub const ALL: &[Preference] = &[Preference::TightestFit, Preference::Spread];

    pub fn as_str(self) -> &'static str {
        match self {
            Preference::TightestFit => "tightest-fit",
            Preference::Spread => "spread",
        }
    }
}

/// The node `preference` picks among `nodes` (ties: the lowest node id).
pub fn place_by<'n>(nodes: impl IntoIterator<Item = &'n NodeDoc>, ask: &Ask<'_>, preference: Preference) -> Option<Placement> {
    let mut best: Option<(u32, &NodeDoc)> = None;
    for node in nodes {
        if let Some(left) = leftover(node, ask)
            && best.is_none_or(|(l, b)| better(preference, left, node, l, b))
        {
            best = Some((left, node));
        }
    }
    best.and_then(|(_, node)| fit(node, ask))
}

/// Rows read per query while loading nodes or reservations.
const ROWS_PER_READ: u32 = 1000;

/// Every row of one kind of a tenant, decoded (paged reads), straight from the stored JSON
/// text into `T`: through a `serde_json::Value` first, the rollouts pass's read of every node
/// of a tenant was a twentieth of a 50-node simulator run.
pub async fn all_rows<T: serde::de::DeserializeOwned>(store: &dyn EventStore, tenant: TenantId, kind: &str) -> Result<Vec<T>> {
    let mut out = Vec::new();
    let mut after: Option<String> = None;
    let tenant = tenant.to_string();
    loop {
        let rows = store.row_list_raw(&tenant, kind, after.as_deref(), ROWS_PER_READ).await?;
        let full = rows.len() == ROWS_PER_READ as usize;
        after = rows.last().map(|r| r.key.id.clone());
        for row in rows {
            out.push(serde_json::from_str(&row.doc).map_err(|e| Error::Internal(format!("{kind} document: {e}")))?);
        }
        if !full {
            return Ok(out);
        }
    }
}

/// What else holds on to node `node` of `tenant`, which [`crate::decide::node_delete`] decides
/// on: its unfinished commands, the live instances on it, the live rollouts that name it.
pub async fn node_holders(store: &dyn EventStore, tenant: TenantId, node: &str) -> Result<crate::decide::NodeHolders> {
    let commands = store.row_get(&tenant.to_string(), crate::KIND_NODE_COMMANDS, node).await?;
    let unfinished_commands = match commands {
        Some(row) => serde_json::from_value::<crate::NodeCommandsDoc>(row.doc)
            .map_err(|e| Error::Internal(format!("node_commands document: {e}")))?
            .pending
            .len(),
        None => 0,
    };
    let instances = all_rows::<crate::instance::InstanceDoc>(store, tenant, crate::instance::KIND_INSTANCE_LIVE)
        .await?
        .into_iter()
        .filter(|i| i.node_id == node)
        .map(|i| i.instance_id)
        .collect();
    let rollouts = all_rows::<crate::rollout::RolloutDoc>(store, tenant, crate::rollout::KIND_ROLLOUT_LIVE)
        .await?
        .into_iter()
        .filter(|r| r.state.is_live() && r.nodes.iter().any(|n| n.node_id == node))
        .map(|r| r.rollout_id)
        .collect();
    Ok(crate::decide::NodeHolders { unfinished_commands, instances, rollouts })
}

/// Every node of a pool.
pub async fn pool_nodes(store: &dyn EventStore, tenant: TenantId, pool: &str) -> Result<Vec<NodeDoc>> {
    let nodes: Vec<NodeDoc> = all_rows(store, tenant, KIND_NODE).await?;
    Ok(nodes.into_iter().filter(|n| n.pool_id == pool).collect())
}

/// A tenant's queued and active reservations.
pub async fn live(store: &dyn EventStore, tenant: TenantId) -> Result<Vec<ReservationDoc>> {
    all_rows(store, tenant, KIND_RESERVATION_LIVE).await
}

/// What one decision appends: its events, and the (stream, version) guards they need.
pub type Appends = (Vec<NewEvent>, Vec<(String, ExpectedVersion)>);

/// The events and guards that give `placement`'s GPUs to a reservation, appended to the
/// reservation's stream: `reservation.activated` there and `node.allocated` on the node's
/// stream, which must still be at the version placement read. On a node with an agent, also
/// `command.issued` (`gpu.hold` for the GPUs' indexes and UUIDs) with `issue`'s id: the
/// reservation's binding is `pending` until the node answers.
pub fn activation(reservation_id: &str, placement: &Placement, ends_at_ms: u64, issue: Issue<'_>) -> Result<Appends> {
    let node_stream = stream_of(KIND_NODE, &placement.node_id);
    let mut events = Vec::new();
    let mut guards = vec![(node_stream.clone(), ExpectedVersion::Exact(placement.node_version))];
    let hold = match &placement.hold {
        Some(uuids) => {
            let args = serde_json::json!({ "reservationId": reservation_id, "gpus": placement.gpus, "gpuUuids": uuids });
            let (command, hold) = issue_command(&placement.node_id, GPU_HOLD, args, issue, &mut guards)?;
            events.push(command);
            Some(hold)
        }
        None => None,
    };
    let activated = ReservationActivated { node_id: placement.node_id.clone(), gpus: placement.gpus.clone(), ends_at_ms, hold };
    events.insert(0, NewEvent::new(RESERVATION_ACTIVATED, to_cbor(&activated)?));
    events.insert(
        1,
        NewEvent {
            stream: Some(node_stream.clone()),
            event_type: NODE_ALLOCATED.into(),
            payload: to_cbor(&NodeAllocated { reservation_id: reservation_id.to_owned(), gpus: placement.gpus.clone() })?,
        },
    );
    Ok((events, guards))
}

/// How an active reservation ends: `reservation.released` or `.expired` (no payload but the
/// release), `.requeued` or `.failed` (a hold that failed).
#[derive(Clone, Debug)]
pub enum Ending {
    Released,
    Expired,
    Requeued { reason: String, attempts: u32 },
    Failed { reason: String, attempts: u32 },
}

/// The events and guards that end an active reservation on `node_id` and give its GPUs back on
/// the node's stream. When the node may hold them (`release`: a hold was sent and not refused,
/// [`crate::Binding::may_hold`]), also `gpu.release` with `issue`'s id, which the reservation
/// records.
pub fn ending(reservation_id: &str, node_id: &str, release: bool, ending: Ending, issue: Issue<'_>) -> Result<Appends> {
    let node_stream = stream_of(KIND_NODE, &node_id);
    let mut events = Vec::new();
    // Freeing commutes with everything else on the node, so any version will do.
    let mut guards = vec![(node_stream.clone(), ExpectedVersion::Any)];
    let release = if release {
        let args = serde_json::json!({ "reservationId": reservation_id });
        let (command, release) = issue_command(node_id, GPU_RELEASE, args, issue, &mut guards)?;
        events.push(command);
        Some(release)
    } else {
        None
    };
    let node_id = node_id.to_owned();
    let (event_type, payload) = match ending {
        Ending::Released => (RESERVATION_RELEASED, to_cbor(&ReservationEnded { release, reason: None })?),
        Ending::Expired => (RESERVATION_EXPIRED, to_cbor(&ReservationEnded { release, reason: None })?),
        Ending::Requeued { reason, attempts } => {
            (RESERVATION_REQUEUED, to_cbor(&ReservationRequeued { node_id, reason, attempts, release })?)
        }
        Ending::Failed { reason, attempts } => {
            (RESERVATION_FAILED, to_cbor(&ReservationFailed { node_id, reason, attempts, release })?)
        }
    };
    events.insert(0, NewEvent::new(event_type, payload));
    events.insert(
        1,
        NewEvent {
            stream: Some(node_stream.clone()),
            event_type: NODE_FREED.into(),
            payload: to_cbor(&NodeFreed { reservation_id: reservation_id.to_owned() })?,
        },
    );
    Ok((events, guards))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selector_parses_and_points_at_the_column() {
        let s = Selector::parse("gpuProduct in (H100-SXM5-80GB, \"A100 80GB\"), vramGiB >= 80, label.rack != r1").unwrap();
        assert_eq!(s.clauses.len(), 3);
        assert_eq!(s.clauses[0].values, ["H100-SXM5-80GB", "A100 80GB"]);
        assert_eq!(Selector::parse("   ").unwrap(), Selector::default());
        for (text, column) in [
            ("vramGiB >> 80", 10),
            ("gpuColour = red", 1),
            ("vramGiB >= lots", 12),
            ("gpuProduct > H100", 12),
            ("gpuProduct in H100", 15),
            ("gpuProduct in (a, b", 20),
            ("vramGiB >= 80 gpuModel = x", 15),
            ("gpuModel = \"x", 12),
            ("vramGiB =", 10),
            ("gpuModel = Ä100", 12),
        ] {
            let e = Selector::parse(text).unwrap_err().to_string();
            assert!(e.contains(&format!("column {column}:")), "{text:?}: {e}");
        }
    }
}
