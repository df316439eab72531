//! Projects (`project/proj_…`): the document, the payloads of `project.*`, and their fold.
//!
//! A project is a tenant's subdivision: a name unique in its tenant and a description.
//! Reservations (and, as they come to carry one, instances and sandboxes) may name a project of
//! their own tenant when they are made; the request is guarded on the project's stream, so an
//! archive racing it makes one of the two fail. An archived project stays (what was made in it
//! still names it) and refuses new work ([`crate::decide::project::check_project_takes_work`]).

use bc_core::Result;
use bc_core::event::StoredEvent;
use bc_core::store::RowKey;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{NoFields, create_once, from_doc, to_doc};

pub const PROJECT_CREATED: &str = "project.created";
pub const PROJECT_ARCHIVED: &str = "project.archived";

/// A project's document; also its stream's prefix (`project/proj_…`).
pub const KIND_PROJECT: &str = "project";

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ProjectDoc {
    pub tenant_id: String,
    pub project_id: String,
    pub name: String,
    pub description: String,
    pub archived: bool,
    /// The stream's version, for `ifVersion`.
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProjectCreated {
    pub name: String,
    pub description: String,
}

pub type ProjectArchived = NoFields;

/// Folds one `project.*` event into the row `key`; any other type leaves the row as it was.
pub(crate) fn apply(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    match env.event_type.as_str() {
        PROJECT_CREATED => create_once(key, &current, event, ("project", "created"), |p: ProjectCreated, env| ProjectDoc {
            tenant_id: env.tenant.to_string(),
            project_id: key.id.clone(),
            name: p.name,
            description: p.description,
            archived: false,
            version: env.version,
            created_at_ms: env.at_ms,
            updated_at_ms: env.at_ms,
        }),
        PROJECT_ARCHIVED => {
            let _: ProjectArchived = crate::payload(event)?;
            let mut doc: ProjectDoc = from_doc(event, current)?;
            doc.archived = true;
            doc.version = env.version;
            doc.updated_at_ms = env.at_ms;
            to_doc(&doc)
        }
        _ => Ok(current),
    }
}
