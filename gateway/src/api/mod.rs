//! The method table: every method of `POST /api/compute/{group}.{method}`, declared once.
//!
//! A method is data, declared with [`method!`] in the file of its group: its name, the action
//! it is authorized as, a summary, the input type its handler parses and the output type it
//! answers with. The router ([`crate::rpc`]), authorization, `better-compute api --list` and the
//! OpenAPI document ([`crate::openapi`]) all read [`table`]; no method name is matched as a
//! string anywhere else, so adding a method touches one file.
//!
//! A handler parses, decides, appends through its [`Call`] and answers with a wire view. What
//! handlers share ([`call`], [`body`], [`validate`], [`paging`], [`resource`]) imports no
//! handler; the wire types ([`views`]) are apart from the stored projection documents, and every
//! input rule a validator enforces is stated in the schema the document publishes.

use std::sync::LazyLock;

use bc_core::Result;
use futures::future::BoxFuture;
use serde_json::Value;

pub mod body;
pub mod call;
pub mod paging;
pub mod resource;
pub mod validate;
pub mod views;

mod access;
mod api_keys;
mod batches;
mod capacity;
mod commands;
mod drivers;
mod events;
pub(crate) mod flavors;
pub mod fleet;
pub(crate) mod images;
mod instances;
mod inventory;
mod join_requests;
mod join_tokens;
mod metal;
pub(crate) use metal::IDEMPOTENCY_KEY_REFUSED;
pub(crate) mod nodes;
mod pools;
mod projects;
mod quotas;
mod releases;
mod reservations;
mod rollouts;
pub(crate) mod sandbox_snapshots;
pub(crate) mod sandbox_volumes;
pub(crate) mod sandboxes;
pub(crate) mod secrets;
mod sites;
mod system;
mod tenants;
mod tunnels;
mod usage;
pub(crate) mod webhooks;

pub use call::Call;
/// A pool's `maxReservationS` bounds, which the CLI's `--max-reservation` checks before sending.
pub use pools::{MAX_RESERVATION_S_LIMIT, MAX_RESERVATION_S_MIN};

/// A handler as the table holds it: the raw JSON body in, the JSON answer out. [`method!`]
/// builds it from a typed handler, so parsing and serializing are the same for every method.
pub type Handler = for<'a> fn(&'a Call<'a>, &'a [u8]) -> BoxFuture<'a, Result<Value>>;
/// The JSON schema of a method's input or output type, for the OpenAPI document.
pub type SchemaOf = fn(&mut schemars::SchemaGenerator) -> schemars::Schema;

/// Who may call a method.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Anyone, without a token.
    Public,
    /// Any valid token: the method shows the caller only what the caller is.
    Authenticated,
    /// A token granted this action in the tenant acted in.
    Action(&'static str),
}

impl Access {
    /// The action as `api --list` and the document's `x-action` show it.
    pub fn action(self) -> Option<&'static str> {
        match self {
            Self::Public => None,
            Self::Authenticated => Some(""),
            Self::Action(action) => Some(action),
        }
    }
}

/// One API method.
pub struct Method {
    pub name: &'static str,
    pub access: Access,
    pub summary: &'static str,
    pub input: SchemaOf,
    pub output: SchemaOf,
    pub handler: Handler,
}

impl Method {
    pub fn group(&self) -> &'static str {
        self.name.split_once('.').map(|(group, _)| group).unwrap_or(self.name)
    }
}

/// Declares one method: `method!("pools.get", Action("compute:pools:read"), "one pool",
/// PoolRef => PoolView, pools_get)`, where `async fn pools_get(&Call, PoolRef) ->
/// Result<PoolView>`.
macro_rules! method {
    ($name:literal, $access:expr, $summary:literal, $input:ty => $output:ty, $handler:path $(,)?) => {
        $crate::api::Method {
            name: $name,
            access: $access,
            summary: $summary,
            input: |g| g.subschema_for::<$input>(),
            output: |g| g.subschema_for::<$output>(),
            handler: |call, body| {
                Box::pin(async move {
                    let input: $input = $crate::api::body::parse(body)?;
                    let output: $output = $handler(call, input).await?;
                    $crate::api::body::to_value(&output)
                })
            },
        }
    };
}
pub(crate) use method;

/// The groups, in the order `api --list` and the document show them.
const GROUPS: &[&[Method]] = &[
    system::METHODS,
    tenants::METHODS,
    api_keys::METHODS,
    pools::METHODS,
    nodes::METHODS,
    drivers::METHODS,
    access::METHODS,
    inventory::METHODS,
    join_tokens::METHODS,
    join_requests::METHODS,
    commands::METHODS,
    batches::METHODS,
    capacity::METHODS,
    reservations::METHODS,
    quotas::METHODS,
    flavors::METHODS,
    images::METHODS,
    instances::METHODS,
    sandboxes::METHODS,
    sandbox_volumes::METHODS,
    sandbox_snapshots::METHODS,
    metal::METHODS,
    releases::METHODS,
    rollouts::METHODS,
    events::METHODS,
    webhooks::METHODS,
    secrets::METHODS,
    sites::METHODS,
    projects::METHODS,
    tunnels::METHODS,
    usage::METHODS,
    fleet::METHODS,
];

static TABLE: LazyLock<Vec<&'static Method>> = LazyLock::new(|| {
    let table: Vec<&'static Method> = GROUPS.iter().flat_map(|group| group.iter()).collect();
    let mut names: Vec<&str> = table.iter().map(|m| m.name).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), table.len(), "a method is declared twice");
    table
});

/// Every method.
pub fn table() -> &'static [&'static Method] {
    &TABLE
}

/// The method called `name`.
pub fn find(name: &str) -> Option<&'static Method> {
    table().iter().copied().find(|m| m.name == name)
}

/// Longest method name looked up: the longest in the table is about 22 bytes. A longer name is
/// `NOT_FOUND` at once, before any work that grows with its length (the "did you mean" compares
/// a name with every method's, before authentication).
pub const METHOD_NAME_BYTES_MAX: usize = 100;
const _: () = assert!(METHOD_NAME_BYTES_MAX >= 64);

#[cfg(test)]
thread_local! {
    /// How often this thread computed a suggestion: the unknown-method test counts the work.
    pub(crate) static SUGGEST_CALLS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// The method name closest to `name`, for "did you mean"; none for a name longer than
/// [`METHOD_NAME_BYTES_MAX`], which is compared with nothing.
pub fn suggest(name: &str) -> Option<&'static str> {
    if name.len() > METHOD_NAME_BYTES_MAX {
        return None;
    }
    #[cfg(test)]
    SUGGEST_CALLS.with(|calls| calls.set(calls.get() + 1));
    table()
        .iter()
        .map(|m| (strsim::jaro_winkler(m.name, name), m.name))
        .filter(|(score, _)| *score >= 0.7)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, name)| name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_method_is_named_group_dot_method_and_authorized_by_a_known_action() {
        for m in table() {
            let (group, rest) = m.name.split_once('.').expect("GROUP.METHOD");
            assert!(!group.is_empty() && !rest.is_empty() && !rest.contains('.'), "{}", m.name);
            if let Access::Action(action) = m.access {
                assert!(crate::auth::ACTIONS.contains(&action), "{}: unknown action {action}", m.name);
            }
        }
        assert_eq!(suggest("pools.lsit"), Some("pools.list"));
        assert_eq!(suggest("zzzzzzzz"), None);
        assert!(table().iter().all(|m| m.name.len() <= METHOD_NAME_BYTES_MAX), "a method name is longer than the bound");
    }
}
