//! `bc-projections`: read models folded from the event log.
//!
//! Every read model is a JSON document per entity, keyed by (tenant, kind, id), where kind and
//! id come from the event's stream name (`pool/pool_…` → kind `pool`, id `pool_…`). The fold is
//! a pure function ([`Projections::apply`]); the store runs it inside the append transaction and
//! again, from the whole log, in `better-compute projections rebuild`.
//!
//! Invariants every fold keeps:
//! - it is deterministic: the same events give the same documents, byte for byte, in every
//!   process and on every rebuild (ordered maps, no clock, no randomness, no IO);
//! - an event that cannot apply (a payload that does not parse, an entity it changes that does
//!   not exist) is a broken log, refused as `Corrupt` naming the event, never skipped;
//! - an event of a type an aggregate does not know leaves its row as it was.
//!
//! Each aggregate's module holds its documents, its event types and payloads, and its fold;
//! [`events`] is the log's wire format in one place. The decisions ([`decide`]) and the
//! in-memory fleet index ([`fleet`]) read the documents and never write them.

use bc_core::event::{Envelope, StoredEvent};
use bc_core::store::{Projector, RowKey};
use bc_core::{Error, Result, canonical};
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub mod batch;
mod checkpoint;
pub mod command;
pub mod decide;
pub mod drivers;
pub mod event_view;
pub mod events;
pub mod flavor;
pub mod fleet;
pub mod fleet_config;
pub mod image;
pub mod instance;
pub mod inventory;
pub mod join_request;
pub mod join_token;
pub mod metal;
pub mod node;
pub mod node_ca;
pub mod placement;
pub mod pool;
pub mod project;
pub mod quota;
pub mod reservation;
pub mod rollout;
pub mod sandbox;
pub mod sandbox_snapshot;
pub mod sandbox_volume;
pub mod secret;
pub mod site;
pub mod tenant;
pub mod tunnel;
pub mod usage;
pub mod webhook;
pub mod workflow;

pub use command::{
    COMMANDS_PENDING_PER_NODE_MAX, CommandDoc, CommandState, KIND_COMMAND, KIND_COMMAND_LIVE, KIND_NODE_COMMANDS, NodeCommandsDoc,
};
pub use event_view::{CoveredBy, EventView, event_view};
use events::*;
pub use flavor::{FlavorDoc, KIND_FLAVOR};
pub use image::{ImageDoc, KIND_IMAGE};
pub use instance::{
    INSTANCE_APPLY, INSTANCE_APPLY_ATTEMPTS_MAX, INSTANCE_APPLY_DEADLINE_S, InstanceDoc, InstanceState, KIND_INSTANCE,
    KIND_INSTANCE_LIVE,
};
pub use join_request::{JoinRequestDoc, JoinRequestState, KIND_JOIN_REQUEST, KIND_JOIN_REQUEST_PENDING};
pub use join_token::{JoinTokenDoc, KIND_JOIN_TOKEN};
pub use node::{KIND_AGENT, KIND_NODE, NodeAgent, NodeDoc, NodeState, Observation, gpus_of_inventory};
pub use pool::{KIND_POOL, KIND_POOL_OFFER, MAX_RESERVATION_S_DEFAULT, PoolDoc, PoolOfferDoc};
pub use quota::{KIND_QUOTA, KIND_RESERVATION_REF, QuotaDoc, ReservationRefDoc};
pub use reservation::{
    Binding, BindingState, HOLD_ATTEMPTS_MAX, HOLD_DEADLINE_S, KIND_RESERVATION, KIND_RESERVATION_LIVE, ReservationDoc,
    ReservationState,
};
pub use secret::{KIND_SECRET, SecretDoc};
pub use tenant::{ApiKeyDoc, KIND_API_KEY, KIND_TENANT, TenantDoc, api_key_secret_id};
pub use webhook::{
    KIND_WEBHOOK, PREVIOUS_SECRETS_MAX, PreviousSecret, WEBHOOK_CONSUMER, WebhookDoc, new_webhook_secret_id, webhook_delivery_id,
};

/// The id part of a stream name (`metal/node_…` → `node_…`).
pub fn stream_id_of(stream: &str) -> &str {
    stream.split_once('/').map_or(stream, |(_, id)| id)
}

/// The stream of one entity: `KIND/ID`.
pub fn stream_of(kind: &str, id: &impl std::fmt::Display) -> String {
    format!("{kind}/{id}")
}

/// Parses one of `all` by its `as_str` word, or names the allowed words.
pub(crate) fn state_from_str<T: Copy>(what: &str, text: &str, all: &[T], as_str: impl Fn(T) -> &'static str) -> Result<T> {
    all.iter().copied().find(|s| as_str(*s) == text).ok_or_else(|| Error::InvalidArgument {
        message: format!("state {:?} is not a {what} state", bc_core::id::truncate(text, 40)),
        hint: Some(all.iter().map(|s| as_str(*s)).collect::<Vec<_>>().join(", ")),
    })
}

/// The projector for every read model of this crate.
#[derive(Clone, Copy, Debug, Default)]
pub struct Projections;

pub(crate) fn payload<T: for<'de> Deserialize<'de>>(event: &StoredEvent) -> Result<T> {
    serde_json::from_value(canonical::to_json(&event.envelope.payload)).map_err(|e| Error::Corrupt {
        tenant: event.envelope.tenant.to_string(),
        seq: event.envelope.seq,
        what: format!("{} payload does not parse: {e}", event.envelope.event_type),
    })
}

pub(crate) fn corrupt(event: &StoredEvent, what: String) -> Error {
    Error::Corrupt { tenant: event.envelope.tenant.to_string(), seq: event.envelope.seq, what }
}

pub(crate) fn to_doc<T: Serialize>(doc: &T) -> Result<Option<Value>> {
    serde_json::to_value(doc).map(Some).map_err(|e| Error::Internal(format!("projection: {e}")))
}

pub(crate) fn from_doc<T: for<'de> Deserialize<'de>>(event: &StoredEvent, doc: Option<Value>) -> Result<T> {
    let doc = doc.ok_or_else(|| Error::Corrupt {
        tenant: event.envelope.tenant.to_string(),
        seq: event.envelope.seq,
        what: format!("{} applies to an entity that does not exist", event.envelope.event_type),
    })?;
    serde_json::from_value(doc).map_err(|e| Error::Internal(format!("projection document: {e}")))
}

/// The payload of an event that says everything by its type (`flavor.deleted`,
/// `node.cordoned`, …): an empty map on the wire, and nothing else is accepted.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NoFields {}

/// Folds the event that makes a row: the document `make` builds from its payload and envelope.
pub(crate) fn create<P, D>(event: &StoredEvent, make: impl FnOnce(P, &Envelope) -> D) -> Result<Option<Value>>
where
    P: for<'de> Deserialize<'de>,
    D: Serialize,
{
    to_doc(&make(payload(event)?, &event.envelope))
}

/// Folds the event that makes a row made only once (`what` says it, e.g. `flavor … created`):
/// a row that exists already is a broken log, not a new document.
pub(crate) fn create_once<P, D>(
    key: &RowKey,
    current: &Option<Value>,
    event: &StoredEvent,
    what: (&str, &str),
    make: impl FnOnce(P, &Envelope) -> D,
) -> Result<Option<Value>>
where
    P: for<'de> Deserialize<'de>,
    D: Serialize,
{
    let p: P = payload(event)?;
    if current.is_some() {
        let (kind, verb) = what;
        return Err(corrupt(event, format!("{kind} {} {verb} twice", key.id)));
    }
    to_doc(&make(p, &event.envelope))
}

/// Folds an event that changes a row that exists: `change` applies its payload to the document.
pub(crate) fn update<P, D>(event: &StoredEvent, current: Option<Value>, change: impl FnOnce(&mut D, P)) -> Result<Option<Value>>
where
    P: for<'de> Deserialize<'de>,
    D: Serialize + for<'de> Deserialize<'de>,
{
    let p: P = payload(event)?;
    let mut doc: D = from_doc(event, current)?;
    change(&mut doc, p);
    to_doc(&doc)
}

/// Replaces `field` with what a change names, if it names one.
pub(crate) fn set_if<T>(field: &mut T, new: Option<T>) {
    if let Some(new) = new {
        *field = new;
    }
}

/// Folds the event that deletes a row: deleting what does not exist is a broken log, not a no-op.
pub(crate) fn delete_once(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    match current {
        Some(_) => Ok(None),
        None => Err(corrupt(event, format!("{} of {} that does not exist", event.envelope.event_type, key.id))),
    }
}

impl Projector for Projections {
    /// The rows an event changes: its stream's (and the live row beside it), and for the events
    /// that reach across aggregates (a node's reports, a command's, a machine's workflow, a
    /// checkpoint) the rows their module names.
    fn touches(&self, event: &StoredEvent, out: &mut Vec<RowKey>) {
        usage::touches(event, out);
        if checkpoint::is_checkpoint(event) {
            return checkpoint::touches(event, out);
        }
        let stream = event.envelope.stream.split_once('/');
        match stream {
            Some((KIND_AGENT, id)) => return node::touches_agent(event, id, out),
            Some((KIND_COMMAND, id)) => return command::touches(event, id, out),
            Some((workflow::KIND_METAL, id)) => return workflow::touches(event, id, out),
            _ => {}
        }
        let report_type = event.envelope.event_type.as_str();
        if GPU_REPORT_TYPES.contains(&report_type)
            || INSTANCE_REPORT_TYPES.contains(&report_type)
            || sandbox::SANDBOX_REPORT_TYPES.contains(&report_type)
            || sandbox_volume::SANDBOX_VOLUME_REPORT_TYPES.contains(&report_type)
            || sandbox_snapshot::SANDBOX_SNAPSHOT_REPORT_TYPES.contains(&report_type)
        {
            command::touches_report(event, out);
        }
        let Some((kind, id)) = stream else { return };
        let live = match kind {
            KIND_RESERVATION => Some(KIND_RESERVATION_LIVE),
            KIND_INSTANCE => Some(KIND_INSTANCE_LIVE),
            sandbox::KIND_SANDBOX => Some(sandbox::KIND_SANDBOX_LIVE),
            sandbox_volume::KIND_SANDBOX_VOLUME => Some(sandbox_volume::KIND_SANDBOX_VOLUME_LIVE),
            sandbox_snapshot::KIND_SANDBOX_SNAPSHOT => Some(sandbox_snapshot::KIND_SANDBOX_SNAPSHOT_LIVE),
            rollout::KIND_ROLLOUT => Some(rollout::KIND_ROLLOUT_LIVE),
            batch::KIND_COMMAND_BATCH => Some(batch::KIND_COMMAND_BATCH_LIVE),
            KIND_JOIN_REQUEST => Some(KIND_JOIN_REQUEST_PENDING),
            KIND_TENANT
            | KIND_API_KEY
            | KIND_POOL
            | KIND_POOL_OFFER
            | KIND_NODE
            | KIND_WEBHOOK
            | KIND_QUOTA
            | KIND_JOIN_TOKEN
            | KIND_FLAVOR
            | KIND_IMAGE
            | KIND_SECRET
            | site::KIND_SITE
            | project::KIND_PROJECT
            | rollout::KIND_RELEASE
            | usage::KIND_USAGE_PRICE
            | batch::KIND_APPROVER_SET
            | fleet_config::KIND_FLEET
            | sandbox::KIND_SANDBOX_TEMPLATE => None,
            _ => return,
        };
        let row = |kind: &str| RowKey { tenant: event.envelope.tenant.to_string(), kind: kind.to_owned(), id: id.to_owned() };
        if kind == KIND_QUOTA {
            quota::touches(event, out);
        }
        out.push(row(kind));
        out.extend(live.map(row));
    }

    /// Hands the event to its aggregate's fold. The aggregate is named by the event type's first
    /// word, which is its stream's kind but for a node's agent's reports (`node.*` on `agent/…`)
    /// and its GPU reports (`gpu.*` on the reservation's stream). Each fold matches its types
    /// exactly; a type no fold knows leaves the row as it was: newer writers may add types that
    /// older readers ignore.
    fn apply(&self, key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
        match key.kind.as_str() {
            usage::KIND_USAGE_LEDGER => return usage::apply_ledger(current, event),
            usage::KIND_USAGE_OPEN => return usage::apply_open(key, current, event),
            usage::KIND_USAGE_PRICE => return usage::apply_price(key, current, event),
            _ => {}
        }
        let aggregate = event.envelope.event_type.split_once('.').map_or("", |(aggregate, _)| aggregate);
        if key.kind == KIND_NODE && aggregate != KIND_NODE && node::on_own_stream(key, event) {
            // Another aggregate's event on the node's own stream (`tunnel.*`): it shows nothing
            // on the node's document, but moves the version decisions guard the node at. (Its
            // agent's reports on `agent/…` go to their aggregate's fold, which advances the
            // node's journal.)
            return node::apply_foreign(current, event);
        }
        match aggregate {
            bc_core::audit::KIND_CHECKPOINT => checkpoint::apply(current, event),
            KIND_TENANT | KIND_API_KEY => tenant::apply(key, current, event),
            KIND_POOL => pool::apply(key, current, event),
            KIND_NODE => node::apply(key, current, event),
            KIND_JOIN_TOKEN => join_token::apply(key, current, event),
            KIND_JOIN_REQUEST | KIND_JOIN_REQUEST_PENDING => join_request::apply(key, current, event),
            KIND_COMMAND => command::apply(key, current, event),
            KIND_RESERVATION | reservation::GPU => reservation::apply(key, current, event),
            KIND_QUOTA => quota::apply(key, current, event),
            KIND_WEBHOOK => webhook::apply(key, current, event),
            KIND_FLAVOR => flavor::apply(key, current, event),
            KIND_IMAGE => image::apply(key, current, event),
            KIND_SECRET => secret::apply(key, current, event),
            site::KIND_SITE => site::apply(key, current, event),
            project::KIND_PROJECT => project::apply(key, current, event),
            KIND_INSTANCE => instance::apply(key, current, event),
            sandbox::KIND_SANDBOX | sandbox::KIND_SANDBOX_TEMPLATE => sandbox::apply(key, current, event),
            sandbox_volume::KIND_SANDBOX_VOLUME => sandbox_volume::apply(key, current, event),
            sandbox_snapshot::KIND_SANDBOX_SNAPSHOT => sandbox_snapshot::apply(key, current, event),
            workflow::KIND_METAL => workflow::apply(key, current, event),
            rollout::KIND_RELEASE | rollout::KIND_ROLLOUT => rollout::apply(key, current, event),
            batch::KIND_APPROVER_SET | batch::KIND_COMMAND_BATCH => batch::apply(key, current, event),
            fleet_config::KIND_FLEET => fleet_config::apply(key, current, event),
            _ => Ok(current),
        }
    }
}
