//! Running what `flags` parsed: [`Command::run`] hands each command group to its module, and
//! [`Context`] carries what they share (the global flags, the client, printing, id checks).
//!
//! One module per group: `api` (any method, the item syntax, the method table), `events`,
//! `pools`, `nodes`, `inventory`, `join_tokens`, `agent_commands` (`commands …`, work for a node's agent), `release` (`releases keygen|sign|verify`, offline), `reservations` (`reserve`, `release`, `extend`, `reservations`, `capacity`,
//! `quotas`), `flavors` (`flavors …`, `images …`), `webhooks`, `auth`, `operator` (`dev`, `serve`, `reconcile`, `migrate`, `pki`,
//! `projections`), `audit`, `sim` (`sim replay`), and `meta` (`completion`, `help`).

use bc_core::id::TenantId;
use serde_json::{Map, Value, json};

use crate::client::{CliError, Client};
use crate::flags::{Command, GlobalArgs, Page};
use crate::output::{self, Column, Format};

pub mod agent_commands;
pub mod api;
pub mod audit;
pub mod auth;
pub mod events;
pub mod flavors;
pub mod instances;
pub mod inventory;
pub mod join_tokens;
pub mod meta;
pub mod metal;
pub mod nodes;
pub mod operator;
pub mod pools;
pub mod releases;
pub mod reservations;
pub mod rollouts;
pub mod sim;
pub mod webhooks;

impl Command {
    pub async fn run(self, ctx: &Context) -> Result<(), CliError> {
        match self {
            Command::Dev(args) => operator::dev(args).await,
            Command::Serve(args) => operator::serve(args).await,
            Command::Reconcile(args) => operator::reconcile(args).await,
            Command::Reconcilers { command } => operator::reconcilers(ctx, command).await,
            Command::Migrate(args) => operator::migrate(ctx, args).await,
            Command::Pki { command } => operator::pki(ctx, command).await,
            Command::Projections { command } => operator::projections(ctx, command).await,
            Command::Audit { command } => audit::run(ctx, command).await,
            Command::Sim { command } => sim::run(ctx, command).await,
            Command::Api(args) => api::run(ctx, args).await,
            Command::Events { command } => events::run(ctx, command).await,
            Command::Pools { command } => pools::run(ctx, command).await,
            Command::Nodes { command } => nodes::run(ctx, command).await,
            Command::Inventory { command } => inventory::run(ctx, command).await,
            Command::JoinTokens { command } => join_tokens::run(ctx, command).await,
            Command::Commands { command } => agent_commands::run(ctx, command).await,
            Command::Releases { command } => releases::run(ctx, command).await,
            Command::Reserve(args) => reservations::reserve(ctx, args).await,
            Command::Release(args) => reservations::release(ctx, args).await,
            Command::Extend(args) => reservations::extend(ctx, args).await,
            Command::Reservations { command } => reservations::run(ctx, command).await,
            Command::Capacity(args) => reservations::capacity(ctx, args).await,
            Command::Quotas { command } => reservations::quotas(ctx, command).await,
            Command::Flavors { command } => flavors::run(ctx, command).await,
            Command::Images { command } => flavors::images(ctx, command).await,
            Command::Rollouts { command } => rollouts::run(ctx, command).await,
            Command::Instances { command } => instances::run(ctx, command).await,
            Command::Metal { command } => metal::run(ctx, command).await,
            Command::Workflows { command } => metal::workflows(ctx, command).await,
            Command::Auth { command } => auth::run(ctx, command).await,
            Command::Webhooks { command } => webhooks::run(ctx, command).await,
            Command::Completion(args) => meta::completion(args.shell),
            Command::Help(args) => meta::help(&args.command, args.json),
        }
    }
}

/// What every command may use: the global flags and the helpers built on them.
pub struct Context {
    pub global: GlobalArgs,
}

impl Context {
    pub fn new(global: GlobalArgs) -> Self {
        Self { global }
    }

    pub fn client(&self) -> Result<Client, CliError> {
        Client::new(&self.global.url, Some(crate::credentials::token(&self.global.url)?))
    }

    /// Prints a result: `--format` if given, else `default`; `--query` selects part of it.
    pub fn print(&self, value: &Value, default: Format) -> Result<(), CliError> {
        let text = output::render(value, self.global.format.unwrap_or(default), self.global.query.as_deref())
            .map_err(CliError::usage)?;
        output::emit(&text);
        Ok(())
    }

    /// Prints a list: a table of `columns` by default; `--format json|compact` and `--query` see
    /// the raw result.
    pub fn print_list(&self, value: &Value, columns: &[Column]) -> Result<(), CliError> {
        if self.global.format.unwrap_or(Format::Table) == Format::Table && self.global.query.is_none() {
            output::emit(&output::table_of(value, columns, now_ms()));
            return Ok(());
        }
        self.print(value, Format::Table)
    }

    /// A body holding `--tenant`, checked, when it is given.
    pub fn tenant_body(&self) -> Result<Map<String, Value>, CliError> {
        let mut body = Map::new();
        if let Some(t) = &self.global.tenant {
            body.insert("tenantId".into(), Value::String(check_id::<TenantId>("--tenant", t)?));
        }
        Ok(body)
    }

    /// `tenant_body` with `--limit` and `--cursor`.
    pub fn page_body(&self, page: &Page) -> Result<Map<String, Value>, CliError> {
        let mut body = self.tenant_body()?;
        add_page(&mut body, page);
        Ok(body)
    }

    /// `--tenant` as a typed id, for the commands that open the database themselves.
    pub fn tenant_id(&self) -> Result<Option<TenantId>, CliError> {
        self.global
            .tenant
            .as_deref()
            .map(|t| t.parse::<TenantId>().map_err(|e| CliError::usage(format!("--tenant: {e}"))))
            .transpose()
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

/// The known name nearest to `wanted` (Levenshtein distance), for a "did you mean"; none when
/// even the nearest differs in more than half of its letters.
pub fn nearest<'a>(wanted: &str, names: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    names
        .map(|name| (strsim::levenshtein(name, wanted), name))
        .min()
        .filter(|(distance, _)| *distance <= wanted.chars().count().div_ceil(2))
        .map(|(_, name)| name)
}

/// Checks an id's kind before anything is sent: a wrong one is a usage error.
pub fn check_id<T: std::str::FromStr<Err = bc_core::Error>>(what: &str, text: &str) -> Result<String, CliError> {
    text.parse::<T>().map(|_| text.to_owned()).map_err(|e| CliError::usage(format!("{what}: {e}")))
}

pub fn add_page(body: &mut Map<String, Value>, page: &Page) {
    if let Some(limit) = page.limit {
        body.insert("limit".into(), json!(limit));
    }
    if let Some(cursor) = &page.cursor {
        body.insert("cursor".into(), json!(cursor));
    }
}

/// `--label key=value`, repeatable, as an object.
pub fn labels(items: &[String]) -> Result<Value, CliError> {
    let mut map = Map::new();
    for item in items {
        let (k, v) = item.split_once('=').ok_or_else(|| CliError::usage(format!("--label {item:?} is not key=value")))?;
        map.insert(k.to_owned(), Value::String(v.to_owned()));
    }
    Ok(Value::Object(map))
}

/// The key a create sends: the user's `--key`, or a fresh one, printed so a retry can reuse it.
pub fn idempotency_key(given: &Option<String>) -> String {
    let key = given.clone().unwrap_or_else(|| format!("cli-{}", ulid::Ulid::generate().to_string().to_ascii_lowercase()));
    eprintln!("idempotency key: {key}");
    key
}
