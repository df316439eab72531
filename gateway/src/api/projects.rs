//! `projects.*`: a tenant's subdivisions. A project is a name unique in its tenant and a
//! description (`project/proj_…`); it is never deleted, only archived, so what was made in it
//! keeps naming it. `reservations.create` takes a `projectId` of the asking tenant: a live
//! project, whose stream the request guards, so an archive racing it makes one of the two
//! `CONFLICT`; an archived project takes no new work (`INVALID_STATE`).

use bc_core::Result;
use bc_core::id::{ProjectId, TenantId};
use bc_projections::decide::project::{
    PROJECTS_PER_TENANT_MAX, ProjectRef, check_project_takes_work, project_archive, project_create,
};
use bc_projections::project::{KIND_PROJECT, ProjectDoc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::body::parse_id;
use super::call::{check_if_version, doc};
use super::paging::{Page, list_input};
use super::resource::{Resource, list_where};
use super::validate::{
    DESCRIPTION_CHARS_MAX, DescriptionText, NameText, ProjectIdText, TenantIdText, VersionNumber, validate_name, validate_text,
};
use super::{Access, Call, Method, method};

const READ: Access = Access::Action("compute:projects:read");
const WRITE: Access = Access::Action("compute:projects:write");
const _: () = assert!(PROJECTS_PER_TENANT_MAX as u32 <= bc_core::store::READ_ROWS_MAX);

pub(super) const METHODS: &[Method] = &[
    method!("projects.create", WRITE, "create a project: a subdivision of the tenant", ProjectsCreate => ProjectView, projects_create),
    method!("projects.get", READ, "one project", ProjectRefInput => ProjectView, projects_get),
    method!("projects.list", READ, "a tenant's projects, paged by cursor", ProjectsList => Page<ProjectView>, projects_list),
    method!(
        "projects.archive",
        WRITE,
        "archive a project: it takes no new work; what was made in it keeps naming it",
        ProjectRefInput => ProjectView,
        projects_archive,
    ),
];

impl Resource for ProjectDoc {
    const KIND: &'static str = KIND_PROJECT;
    const WHAT: &'static str = "project";
    const ID_FIELD: &'static str = "projectId";
    type Id = ProjectId;
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProjectsCreate {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    /// Unique within the tenant, archived projects included.
    #[schemars(with = "NameText")]
    name: String,
    #[serde(default)]
    #[schemars(with = "DescriptionText")]
    description: String,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProjectRefInput {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "ProjectIdText")]
    project_id: String,
    /// Act only while the project is at this version.
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
}

list_input!(ProjectsList {
    /// Archived projects too.
    #[serde(default)]
    include_archived: bool,
});

/// A project as the API shows it.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProjectView {
    #[schemars(with = "ProjectIdText")]
    pub project_id: String,
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "NameText")]
    pub name: String,
    #[schemars(with = "DescriptionText")]
    pub description: String,
    /// Archived: it takes no new work.
    pub archived: bool,
    /// The stream's version, for `ifVersion`.
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

impl From<ProjectDoc> for ProjectView {
    fn from(d: ProjectDoc) -> Self {
        Self {
            project_id: d.project_id,
            tenant_id: d.tenant_id,
            name: d.name,
            description: d.description,
            archived: d.archived,
            version: d.version,
            created_at_ms: d.created_at_ms,
            updated_at_ms: d.updated_at_ms,
        }
    }
}

/// The project `project` of `tenant`, or `NOT_FOUND`.
async fn project_doc(call: &Call<'_>, tenant: TenantId, project: &ProjectId) -> Result<ProjectDoc> {
    call.row(tenant, KIND_PROJECT, &project.to_string(), "project").await
}

/// The project a new piece of work names (`projectId`, parsed): `tenant`'s own and live, as
/// the append will guard it. A retry is answered from the log whatever the project says now,
/// so it is only read.
pub(super) async fn project_for_work(call: &Call<'_>, tenant: TenantId, project_id: &str) -> Result<ProjectRef> {
    let id: ProjectId = parse_id("projectId", project_id)?;
    let project = project_doc(call, tenant, &id).await?;
    if call.is_retry(tenant).await? {
        return Ok(ProjectRef { project_id: project.project_id, version: project.version });
    }
    check_project_takes_work(&project)
}

async fn projects_create(call: &Call<'_>, input: ProjectsCreate) -> Result<ProjectView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    validate_name("name", &input.name)?;
    validate_text("description", &input.description, DESCRIPTION_CHARS_MAX)?;
    // Names are checked and taken under the tenant's lock; a retry is answered from the log.
    let _names = call.state.name_locks.lock(tenant).await;
    let existing = if call.is_retry(tenant).await? {
        Vec::new()
    } else {
        let rows = call.state.store.row_list(&tenant.to_string(), KIND_PROJECT, None, PROJECTS_PER_TENANT_MAX as u32).await?;
        rows.into_iter().map(doc::<ProjectDoc>).collect::<Result<Vec<_>>>()?
    };
    let append = project_create(&existing, ProjectId::from_ulid(call.ulid()), &input.name, &input.description)?;
    let result = call.submit(call.decided(tenant, append)).await?;
    Ok(call.created::<ProjectDoc>(tenant, &result).await?.into())
}

async fn projects_get(call: &Call<'_>, input: ProjectRefInput) -> Result<ProjectView> {
    check_if_version(input.if_version)?;
    Ok(call.named::<ProjectDoc>(&input.tenant_id, &input.project_id).await?.into())
}

async fn projects_list(call: &Call<'_>, input: ProjectsList) -> Result<Page<ProjectView>> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let include_archived = input.include_archived;
    list_where(call, tenant, input.limit, input.cursor.as_deref(), |p: &ProjectDoc| include_archived || !p.archived).await
}

async fn projects_archive(call: &Call<'_>, input: ProjectRefInput) -> Result<ProjectView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let id: ProjectId = parse_id("projectId", &input.project_id)?;
    check_if_version(input.if_version)?;
    let project = project_doc(call, tenant, &id).await?;
    if let Some(append) = project_archive(&project, input.if_version)? {
        call.submit(call.decided(tenant, append)).await?;
    }
    Ok(project_doc(call, tenant, &id).await?.into())
}
