//! `sites list|get|create|update|delete` and `projects list|get|create|archive`: where machines
//! are, and a tenant's subdivisions (the `sites.*` and `projects.*` methods). The server checks
//! every bound; the CLI checks only ids, so a refusal reads the same from the CLI and the API.

use bc_core::id::{ProjectId, SiteId};
use clap::Subcommand;
use serde_json::json;

use crate::client::CliError;
use crate::flags::{IdempotencyKey, IfVersion, Page};
use crate::output::Format;
use crate::tables;

use super::{Context, add_if_version, labels, put_id};

#[derive(Subcommand)]
pub enum SitesCommand {
    /// A tenant's sites.
    List {
        #[command(flatten)]
        page: Page,
    },
    /// One site, by its `site_…` id.
    Get { site_id: String },
    /// A site: a name unique in the tenant, a region (fixed for the site's life) and labels.
    Create {
        #[arg(long)]
        name: String,
        /// Where it is (`eu-west-1`): 1 to 63 of a-z 0-9 - . _.
        #[arg(long)]
        region: String,
        /// `key=value`, repeatable.
        #[arg(long = "label")]
        labels: Vec<String>,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// Change a site's name or labels in place (a site's region does not change).
    Update {
        site_id: String,
        #[arg(long)]
        name: Option<String>,
        /// `key=value`, repeatable: the site's labels, all of them (they replace its own).
        #[arg(long = "label")]
        labels: Vec<String>,
        /// Remove every label.
        #[arg(long, conflicts_with = "labels")]
        clear_labels: bool,
        #[command(flatten)]
        if_version: IfVersion,
    },
    /// Delete a site; refused while a live pool names it (the refusal names them).
    Delete {
        site_id: String,
        #[command(flatten)]
        if_version: IfVersion,
    },
}

#[derive(Subcommand)]
pub enum ProjectsCommand {
    /// A tenant's projects (archived ones with --include-archived).
    List {
        #[command(flatten)]
        page: Page,
        #[arg(long)]
        include_archived: bool,
    },
    /// One project, by its `proj_…` id.
    Get { project_id: String },
    /// A project: a name unique in the tenant; reservations name it with --project.
    Create {
        #[arg(long)]
        name: String,
        #[arg(long, default_value = "")]
        description: String,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// Archive a project: it takes no new work; what was made in it keeps naming it.
    Archive {
        project_id: String,
        #[command(flatten)]
        if_version: IfVersion,
    },
}

pub async fn sites(ctx: &Context, command: SitesCommand) -> Result<(), CliError> {
    let mut body = ctx.tenant_body()?;
    let value = match command {
        SitesCommand::List { page } => return ctx.list("sites.list", body, &page, tables::SITES).await,
        SitesCommand::Get { site_id } => {
            put_id::<SiteId>(&mut body, "siteId", "SITE_ID", &site_id)?;
            ctx.call("sites.get", body, None).await?
        }
        SitesCommand::Create { name, region, labels: items, key } => {
            body.insert("name".into(), json!(name));
            body.insert("region".into(), json!(region));
            body.insert("labels".into(), labels(&items)?);
            ctx.create("sites.create", body, &key).await?
        }
        SitesCommand::Update { site_id, name, labels: items, clear_labels, if_version } => {
            put_id::<SiteId>(&mut body, "siteId", "SITE_ID", &site_id)?;
            if name.is_none() && items.is_empty() && !clear_labels {
                return Err(CliError::usage("nothing to update: give --name, --label or --clear-labels"));
            }
            if let Some(name) = name {
                body.insert("name".into(), json!(name));
            }
            if !items.is_empty() || clear_labels {
                body.insert("labels".into(), labels(&items)?);
            }
            add_if_version(&mut body, &if_version);
            ctx.call("sites.update", body, None).await?
        }
        SitesCommand::Delete { site_id, if_version } => {
            put_id::<SiteId>(&mut body, "siteId", "SITE_ID", &site_id)?;
            add_if_version(&mut body, &if_version);
            ctx.call("sites.delete", body, None).await?
        }
    };
    ctx.print(&value, Format::Json)
}

pub async fn projects(ctx: &Context, command: ProjectsCommand) -> Result<(), CliError> {
    let mut body = ctx.tenant_body()?;
    let value = match command {
        ProjectsCommand::List { page, include_archived } => {
            body.insert("includeArchived".into(), json!(include_archived));
            return ctx.list("projects.list", body, &page, tables::PROJECTS).await;
        }
        ProjectsCommand::Get { project_id } => {
            put_id::<ProjectId>(&mut body, "projectId", "PROJECT_ID", &project_id)?;
            ctx.call("projects.get", body, None).await?
        }
        ProjectsCommand::Create { name, description, key } => {
            body.insert("name".into(), json!(name));
            body.insert("description".into(), json!(description));
            ctx.create("projects.create", body, &key).await?
        }
        ProjectsCommand::Archive { project_id, if_version } => {
            put_id::<ProjectId>(&mut body, "projectId", "PROJECT_ID", &project_id)?;
            add_if_version(&mut body, &if_version);
            ctx.call("projects.archive", body, None).await?
        }
    };
    ctx.print(&value, Format::Json)
}
