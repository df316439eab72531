//! Projects (`projects.create`, `projects.archive`, and the project a new reservation names):
//! what each appends, or why not. Pure: the gateway reads the tenant's projects, draws the new
//! id, and appends what these say.

use bc_core::id::ProjectId;
use bc_core::store::{ExpectedVersion, NewEvent};
use bc_core::{Error, Result};

use super::Append;
use crate::events::{self as ev, to_cbor};
use crate::project::{KIND_PROJECT, ProjectDoc};
use crate::stream_of;

/// Projects one tenant holds at most, archived ones too: a create reads them all (the name's
/// uniqueness).
pub const PROJECTS_PER_TENANT_MAX: usize = 1000;

/// A new project `new_id` called `name` (free in the tenant, archived projects' names too:
/// what was made in them still names them) within the tenant's bound.
pub fn project_create(existing: &[ProjectDoc], new_id: ProjectId, name: &str, description: &str) -> Result<Append> {
    if let Some(same) = existing.iter().find(|p| p.name == name) {
        return Err(Error::AlreadyExists { what: format!("project {name:?} ({})", same.project_id) });
    }
    if existing.len() >= PROJECTS_PER_TENANT_MAX {
        return Err(Error::state(
            format!("a tenant has at most {PROJECTS_PER_TENANT_MAX} projects"),
            "projects are never deleted: reuse one",
        ));
    }
    let payload = to_cbor(&ev::ProjectCreated { name: name.to_owned(), description: description.to_owned() })?;
    Ok(Append {
        stream: stream_of(KIND_PROJECT, &new_id),
        expected: ExpectedVersion::NoStream,
        guards: Vec::new(),
        events: vec![NewEvent::new(ev::PROJECT_CREATED, payload)],
    })
}

/// An archive of `doc` (at `if_version` when given); `None` when it is archived already
/// (archiving again changes nothing, whatever version it names).
pub fn project_archive(doc: &ProjectDoc, if_version: Option<u64>) -> Result<Option<Append>> {
    if doc.archived {
        return Ok(None);
    }
    let stream = stream_of(KIND_PROJECT, &doc.project_id);
    if let Some(wanted) = if_version
        && wanted != doc.version
    {
        return Err(Error::Conflict { stream, expected: format!("version {wanted}"), actual: doc.version });
    }
    Ok(Some(Append {
        stream,
        expected: ExpectedVersion::Exact(doc.version),
        guards: Vec::new(),
        events: vec![NewEvent::new(ev::PROJECT_ARCHIVED, to_cbor(&ev::ProjectArchived {})?)],
    }))
}

/// A live project new work is made in, as read: the work's append guards its stream at this
/// version ([`ProjectRef::guard`]), so an archive racing it makes one of the two `CONFLICT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProjectRef {
    pub project_id: String,
    pub version: u64,
}

impl ProjectRef {
    /// The guard on the project's stream at the version read.
    pub fn guard(&self) -> (String, ExpectedVersion) {
        (stream_of(KIND_PROJECT, &self.project_id), ExpectedVersion::Exact(self.version))
    }
}

/// Whether new work may be made in `doc`: a live project does (answered as the [`ProjectRef`]
/// its append guards); an archived project is `INVALID_STATE`.
pub fn check_project_takes_work(doc: &ProjectDoc) -> Result<ProjectRef> {
    if doc.archived {
        return Err(Error::state(
            format!("project {:?} ({}) is archived: it takes no new work", doc.name, doc.project_id),
            "name a live project (projects list), or none",
        ));
    }
    Ok(ProjectRef { project_id: doc.project_id.clone(), version: doc.version })
}

#[cfg(test)]
mod tests {
    use bc_core::ErrorCode;

    use super::*;

    fn doc(name: &str, n: usize, archived: bool) -> ProjectDoc {
        ProjectDoc {
            tenant_id: bc_core::id::TenantId::ROOT.to_string(),
            project_id: format!("proj_{n}"),
            name: name.into(),
            description: String::new(),
            archived,
            version: 2 + u64::from(archived),
            created_at_ms: 0,
            updated_at_ms: 0,
        }
    }

    fn id() -> ProjectId {
        ProjectId::from_ulid(ulid::Ulid::from_parts(7, 7))
    }

    #[test]
    fn a_project_is_made_under_a_name_no_project_of_the_tenant_holds() {
        let made = project_create(&[], id(), "ml", "training").unwrap();
        assert_eq!(made.stream, format!("project/{}", id()));
        assert_eq!(made.expected, ExpectedVersion::NoStream);
        assert_eq!(made.event_types(), vec![ev::PROJECT_CREATED]);
        let err = project_create(&[doc("ml", 0, true)], id(), "ml", "").unwrap_err();
        assert_eq!(err.code(), ErrorCode::AlreadyExists, "an archived project's name stays taken: {err}");
        let full: Vec<ProjectDoc> = (0..PROJECTS_PER_TENANT_MAX).map(|n| doc(&format!("p{n}"), n, false)).collect();
        assert_eq!(project_create(&full, id(), "one-more", "").unwrap_err().code(), ErrorCode::InvalidState);
    }

    #[test]
    fn an_archive_happens_once_and_an_archived_project_takes_no_work() {
        let live = doc("ml", 0, false);
        let append = project_archive(&live, Some(2)).unwrap().unwrap();
        assert_eq!(append.event_types(), vec![ev::PROJECT_ARCHIVED]);
        assert_eq!(append.expected, ExpectedVersion::Exact(2));
        assert_eq!(project_archive(&live, Some(1)).unwrap_err().code(), ErrorCode::Conflict);
        let archived = doc("ml", 0, true);
        assert_eq!(project_archive(&archived, Some(1)).unwrap(), None, "archiving again appends nothing");

        let taken = check_project_takes_work(&live).unwrap();
        assert_eq!(taken.guard(), ("project/proj_0".into(), ExpectedVersion::Exact(2)));
        let err = check_project_takes_work(&archived).unwrap_err();
        assert_eq!(err.code(), ErrorCode::InvalidState);
        assert!(err.to_string().contains("proj_0"), "{err}");
    }
}
