//! `commands.*`: work for one node's agent. A command is an event on its own stream
//! (`command.issued`); the node's session delivers its unfinished commands in issue order
//! (again after every reconnect), the agent runs each once and journals `command.started` and
//! `command.succeeded` or `command.failed`, which come back into the log through the journal. A
//! command not run by its deadline fails.

use bc_core::Error;
use bc_core::Result;
use bc_core::id::{CommandId, NodeId, RolloutId, TenantId};
use bc_core::store::ExpectedVersion;
use bc_projections::events as ev;
use bc_projections::rollout::{KIND_RELEASE, ReleaseDoc};
use bc_projections::{
    COMMANDS_PENDING_PER_NODE_MAX, CommandDoc, CommandState, KIND_COMMAND, KIND_NODE, KIND_NODE_COMMANDS, NodeCommandsDoc,
    NodeDoc, stream_of,
};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::Value;

use schemars::json_schema;

use super::body::parse_id;
use super::call::doc;
use super::paging::Page;
use super::resource::list_by;
use super::validate::{CommandIdText, CursorText, LimitNumber, NodeIdText, RolloutIdText, TenantIdText, string_schema};
use super::views::CommandView;
use super::{Access, Call, Method, method};

const READ: Access = Access::Action("compute:commands:read");
const WRITE: Access = Access::Action("compute:commands:write");

/// A command's deadline unless it says otherwise, and the longest.
pub const COMMAND_DEADLINE_S_DEFAULT: u64 = 300;
pub const COMMAND_DEADLINE_S_MAX: u64 = 24 * 3600;
/// The command kinds an API caller issues. `gpu.hold` and `gpu.release` are the control
/// plane's own: a reservation's activation and ending issue them (`placement::activation`,
/// `placement::ending`), so GPUs are never set aside outside a reservation.
/// `agent.update` and `agent.rollback` are also what a rollout sends (`rollouts`, and its
/// abort), and have their own default deadline, [`bc_core::release::UPDATE_COMMAND_DEADLINE_S`].
pub const COMMAND_KINDS: &[&str] = &["ping", AGENT_UPDATE, AGENT_ROLLBACK];
/// The command that has an agent take a signed release (`bcd` verifies it against its pinned
/// release keys, switches slots and re-executes).
pub const AGENT_UPDATE: &str = bc_projections::rollout::AGENT_UPDATE;
/// The command that has an agent go back to the version its previous slot holds (the entrypoint
/// pointed back, a re-exec, the watchdog armed as for an update).
pub const AGENT_ROLLBACK: &str = bc_projections::rollout::AGENT_ROLLBACK;

pub(super) const METHODS: &[Method] = &[
    method!("commands.issue", WRITE, "send a command to a node's agent", CommandsIssue => CommandView, commands_issue),
    method!("commands.get", READ, "one command", CommandRef => CommandView, commands_get),
    method!("commands.list", READ, "a tenant's commands, of one node or all, paged by cursor", CommandsList => Page<CommandView>, commands_list),
    method!("commands.cancel", WRITE, "cancel a command that has not finished", CommandRef => CommandView, commands_cancel),
];

string_schema!(
    /// `ping` (answer at once), `agent.update` (take a signed release), `agent.rollback` (go
    /// back to the version the previous slot holds).
    CommandKindText,
    json_schema!({ "type": "string", "enum": COMMAND_KINDS })
);

#[derive(Deserialize, JsonSchema, serde::Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PingArgs {}

/// `agent.update`'s arguments: a signed release, exactly as signed. The gateway checks their
/// bounds and that the manifest is one, then that it is one of the tenant's registered releases,
/// still signed under a release key the control plane trusts and, if it allows a downgrade,
/// within its `notAfter` (`decide::agent_update_issue`); the agent checks the signature again
/// against its own pinned release keys (the control plane is not what it trusts).
#[derive(Deserialize, JsonSchema, serde::Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AgentUpdateArgs {
    /// The release manifest's JSON text, byte for byte as signed (at most 8 KiB).
    #[schemars(length(min = 1, max = bc_core::release::MANIFEST_BYTES_MAX))]
    pub manifest: String,
    /// The signature file's text: `rk_<16 hex> <base64>`.
    #[schemars(length(min = 1, max = bc_core::release::SIGNATURE_BYTES_MAX))]
    pub signature: String,
    /// The rollout that sends it, if one does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<RolloutIdText>")]
    pub rollout_id: Option<RolloutId>,
}

impl AgentUpdateArgs {
    /// The bounds, the signature line's shape and the manifest's fields (not the signature:
    /// that is the agent's to check, under its pins).
    pub fn check(&self) -> Result<()> {
        use bc_core::release::{MANIFEST_BYTES_MAX, Manifest, SIGNATURE_BYTES_MAX, signature_key_id};
        let invalid = |message: String| Error::InvalidArgument {
            message: format!("args of {AGENT_UPDATE}: {message}"),
            hint: Some("pass the files better-compute releases sign wrote: the manifest and its .sig".into()),
        };
        if self.manifest.len() > MANIFEST_BYTES_MAX || self.signature.len() > SIGNATURE_BYTES_MAX {
            return Err(invalid(format!(
                "the manifest is at most {MANIFEST_BYTES_MAX} bytes and the signature {SIGNATURE_BYTES_MAX}"
            )));
        }
        Manifest::parse(self.manifest.as_bytes()).map_err(|e| invalid(e.to_string()))?;
        signature_key_id(&self.signature).map_err(|e| invalid(e.to_string()))?;
        Ok(())
    }
}

/// `agent.rollback`'s arguments: the version to go back to, which the node's previous slot must
/// hold (the agent refuses it `rollback-unavailable` otherwise; already on it, it succeeds at
/// once).
#[derive(Deserialize, JsonSchema, serde::Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AgentRollbackArgs {
    /// A semantic version (at most 64 bytes): the one the node ran before.
    #[schemars(length(min = 1, max = bc_core::release::VERSION_BYTES_MAX))]
    pub to_version: String,
    /// The rollout that sends it, if one does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<RolloutIdText>")]
    pub rollout_id: Option<RolloutId>,
}

impl AgentRollbackArgs {
    pub fn check(&self) -> Result<()> {
        use bc_core::release::{VERSION_BYTES_MAX, is_version};
        if self.to_version.len() > VERSION_BYTES_MAX || !is_version(&self.to_version) {
            return Err(Error::InvalidArgument {
                message: format!(
                    "args of {AGENT_ROLLBACK}: toVersion {:?} is not a semantic version of at most {VERSION_BYTES_MAX} bytes",
                    bc_core::id::truncate(&self.to_version, 40)
                ),
                hint: Some("the version the node ran before, as nodes.get shows it (agentVersion), e.g. 0.1.0".into()),
            });
        }
        Ok(())
    }
}

/// The schema of `args`: one of the kinds' argument objects.
#[derive(JsonSchema)]
#[serde(untagged)]
#[allow(dead_code)] // a schema only
enum CommandArgs {
    Ping(PingArgs),
    AgentUpdate(AgentUpdateArgs),
    AgentRollback(AgentRollbackArgs),
}

/// `args` are the arguments of `kind` (absent: `{}`, which only `ping` takes).
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CommandsIssue {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "NodeIdText")]
    node_id: String,
    #[schemars(with = "CommandKindText")]
    kind: String,
    /// The kind's arguments (`{}` for `ping`; `{manifest, signature, rolloutId?}` for
    /// `agent.update`; `{toVersion, rolloutId?}` for `agent.rollback`).
    #[serde(default)]
    #[schemars(with = "CommandArgs")]
    args: serde_json::Map<String, Value>,
    /// Seconds the node has to run it (default 300; 600 for `agent.update` and
    /// `agent.rollback`).
    #[schemars(range(min = 1, max = COMMAND_DEADLINE_S_MAX))]
    deadline_s: Option<u64>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CommandRef {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "CommandIdText")]
    command_id: String,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CommandsList {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    /// Only this node's commands (a page may then hold fewer than `limit`; follow the cursor).
    #[schemars(with = "Option<NodeIdText>")]
    node_id: Option<String>,
    #[schemars(with = "Option<LimitNumber>")]
    limit: Option<u32>,
    #[schemars(with = "Option<CursorText>")]
    cursor: Option<String>,
}

/// The kind and its arguments, checked against what the kind takes.
fn args_of(kind: &str, args: serde_json::Map<String, Value>) -> Result<(&'static str, Value)> {
    fn parse<T: serde::de::DeserializeOwned>(kind: &str, args: Value) -> Result<T> {
        serde_json::from_value(args).map_err(|e| Error::InvalidArgument {
            message: format!("args of {kind}: {}", bc_core::id::truncate(&e.to_string(), 200)),
            hint: None,
        })
    }
    fn to_value<T: serde::Serialize>(parsed: T) -> Result<Value> {
        serde_json::to_value(parsed).map_err(|e| Error::Internal(format!("command args: {e}")))
    }
    fn typed<T: serde::de::DeserializeOwned + serde::Serialize>(kind: &str, args: Value) -> Result<Value> {
        to_value(parse::<T>(kind, args)?)
    }
    let args = Value::Object(args);
    Ok(match kind {
        "ping" => ("ping", typed::<PingArgs>(kind, args)?),
        AGENT_UPDATE => {
            let parsed: AgentUpdateArgs = parse(kind, args)?;
            parsed.check()?;
            (AGENT_UPDATE, to_value(parsed)?)
        }
        AGENT_ROLLBACK => {
            let parsed: AgentRollbackArgs = parse(kind, args)?;
            parsed.check()?;
            (AGENT_ROLLBACK, to_value(parsed)?)
        }
        "gpu.hold" | "gpu.release" => {
            return Err(Error::InvalidArgument {
                message: format!("{kind} is issued by the control plane, not by a caller"),
                hint: Some("reserve GPUs with reservations.create: its activation sends the node gpu.hold".into()),
            });
        }
        other => {
            return Err(Error::InvalidArgument {
                message: format!("no command kind {:?}", bc_core::id::truncate(other, 40)),
                hint: Some(format!("kinds: {}", COMMAND_KINDS.join(", "))),
            });
        }
    })
}

async fn command_doc(call: &Call<'_>, tenant: TenantId, id: &CommandId) -> Result<CommandDoc> {
    call.row(tenant, KIND_COMMAND, &id.to_string(), "command").await
}

/// Refuses a command for a node that has the most unfinished commands it may have
/// (`commands.issue`, and the `instances.*` requests that send `instance.apply`).
pub(super) async fn check_node_queue(call: &Call<'_>, tenant: TenantId, node_id: &str) -> Result<()> {
    let pending = call
        .state
        .store
        .row_get(&tenant.to_string(), KIND_NODE_COMMANDS, node_id)
        .await?
        .map(doc::<NodeCommandsDoc>)
        .transpose()?
        .unwrap_or_default();
    if pending.pending.len() >= COMMANDS_PENDING_PER_NODE_MAX {
        return Err(Error::Unavailable(format!(
            "node {node_id} has {COMMANDS_PENDING_PER_NODE_MAX} unfinished commands; wait for it to catch up or cancel some"
        )));
    }
    Ok(())
}

async fn commands_issue(call: &Call<'_>, input: CommandsIssue) -> Result<CommandView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let node_id: NodeId = parse_id("nodeId", &input.node_id)?;
    // The node first: the arguments' schema is one per kind (an `anyOf`, not tied to `kind`), so
    // a call to a node that is not there is NOT_FOUND whatever it carries.
    let node: NodeDoc = call.row(tenant, KIND_NODE, &node_id.to_string(), "node").await?;
    let (kind, args) = args_of(&input.kind, input.args)?;
    let deadline_s = input.deadline_s.unwrap_or(if kind == AGENT_UPDATE || kind == AGENT_ROLLBACK {
        bc_core::release::UPDATE_COMMAND_DEADLINE_S
    } else {
        COMMAND_DEADLINE_S_DEFAULT
    });
    if !(1..=COMMAND_DEADLINE_S_MAX).contains(&deadline_s) {
        return Err(Error::invalid(format!("deadlineS must be 1 to {COMMAND_DEADLINE_S_MAX} seconds")));
    }
    if node.agent.is_none() {
        return Err(Error::InvalidArgument {
            message: format!("node {node_id} has no agent: it was registered by hand"),
            hint: Some("commands go to nodes that joined with bcd join".into()),
        });
    }
    if kind == AGENT_UPDATE {
        // Only a registered release, checked again as releases.register checks it: a key that
        // may issue commands but not register releases sends a node nothing register refuses.
        let update: AgentUpdateArgs =
            serde_json::from_value(args.clone()).map_err(|e| Error::Internal(format!("command args: {e}")))?;
        let rows =
            call.state.store.row_list(&tenant.to_string(), KIND_RELEASE, None, super::releases::RELEASES_PER_TENANT_MAX).await?;
        let releases = rows.into_iter().map(doc::<ReleaseDoc>).collect::<Result<Vec<_>>>()?;
        bc_projections::decide::agent_update_issue(
            &call.state.release_keys,
            &releases,
            &update.manifest,
            &update.signature,
            call.now_ms(),
        )?;
    }
    check_node_queue(call, tenant, &node_id.to_string()).await?;
    let command = CommandId::from_ulid(call.ulid());
    let payload = ev::to_cbor(&ev::CommandIssued {
        node_id: node_id.to_string(),
        kind: kind.to_owned(),
        args,
        deadline_at_ms: call.now_ms().saturating_add(deadline_s * 1000),
        release: None,
    })?;
    let result =
        call.append(tenant, stream_of(KIND_COMMAND, &command), ExpectedVersion::NoStream, ev::COMMAND_ISSUED, payload).await?;
    Ok(call.created::<CommandDoc>(tenant, &result).await?.into())
}

async fn commands_get(call: &Call<'_>, input: CommandRef) -> Result<CommandView> {
    Ok(call.named::<CommandDoc>(&input.tenant_id, &input.command_id).await?.into())
}

async fn commands_list(call: &Call<'_>, input: CommandsList) -> Result<Page<CommandView>> {
    let page = (input.limit, input.cursor.as_deref());
    list_by::<CommandDoc, _, NodeId>(call, &input.tenant_id, page, ("nodeId", &input.node_id), |c| &c.node_id).await
}

async fn commands_cancel(call: &Call<'_>, input: CommandRef) -> Result<CommandView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let id: CommandId = parse_id("commandId", &input.command_id)?;
    let current = command_doc(call, tenant, &id).await?;
    if current.state != CommandState::Issued && current.state != CommandState::Started {
        return Ok(current.into());
    }
    if current.kind == bc_projections::INSTANCE_APPLY {
        return Err(Error::state(
            format!("{id} is an instance's {}: it is not cancelled by a caller", current.kind),
            "ask the instance for what it should be instead (instances.start, .stop, .delete)",
        ));
    }
    if current.kind.starts_with("gpu.") {
        // A reservation's hold or release is the control plane's: cancelling a release would
        // leave the GPUs held on the node for good.
        return Err(Error::state(
            format!("{} is a reservation's {}: it is not cancelled by a caller", id, current.kind),
            "release the reservation instead (reservations.release)",
        ));
    }
    let payload = ev::to_cbor(&ev::CommandCancelled {
        node_id: current.node_id.clone(),
        reason: format!("cancelled by {}", call.actor()),
    })?;
    call.append(tenant, stream_of(KIND_COMMAND, &id), ExpectedVersion::Exact(current.version), ev::COMMAND_CANCELLED, payload)
        .await?;
    Ok(command_doc(call, tenant, &id).await?.into())
}
