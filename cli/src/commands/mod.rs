//! Running what the command line parsed: [`Command::run`] hands each command group to its
//! module, and [`Context`] carries what they share (the global flags, the client, printing, id
//! checks, `--wait`'s following).
//!
//! A group's module owns its clap types (its subcommand enum and the flag groups only it uses)
//! and its `run`; flag groups several groups take are in `crate::flags`. Every id is checked for
//! its kind before anything is sent, so a wrong id is a usage error (exit 2) and never a call;
//! every create sends an idempotency key, printed so a retry can reuse it.

use std::time::{Duration, Instant};

use bc_core::id::TenantId;
use serde_json::{Map, Value, json};

use crate::client::{CliError, Client};
use crate::flags::{Command, GlobalArgs, IdempotencyKey, IfVersion, Page};
use crate::output::{self, Column, Format};

pub mod agent_commands;
pub mod api;
pub mod audit;
pub mod auth;
pub mod batch;
pub mod catalogue;
pub mod console;
pub mod drivers;
pub mod events;
pub mod exec;
pub mod flavors;
pub mod fleet;
pub mod forward;
pub mod init;
pub mod instances;
pub mod inventory;
pub mod join_requests;
pub mod join_tokens;
pub mod meta;
pub mod metal;
pub mod nodes;
pub mod operator;
pub mod pools;
pub mod releases;
pub mod reservations;
pub mod rollouts;
pub mod sandboxes;
pub mod secrets;
pub mod sim;
pub mod ssh_cert;
pub mod usage;
pub mod version;
pub mod webhooks;

impl Command {
    pub async fn run(self, ctx: &Context) -> Result<(), CliError> {
        match self {
            Command::Init(args) => init::run(ctx, args),
            Command::Version(args) => version::run(ctx, args),
            Command::Dev(args) => operator::dev(args).await,
            Command::Serve(args) => operator::serve(args).await,
            Command::Reconcile(args) => operator::reconcile(args).await,
            Command::Reconcilers { command } => operator::reconcilers(ctx, command).await,
            Command::Migrate(args) => operator::migrate(ctx, args).await,
            Command::Doctor(args) => operator::doctor(ctx, args).await,
            Command::SupportBundle(args) => crate::support_bundle::run(ctx, args).await,
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
            Command::JoinRequests { command } => join_requests::run(ctx, command).await,
            Command::Drivers { command } => drivers::run(ctx, command).await,
            Command::Commands { command } => agent_commands::run(ctx, command).await,
            Command::Releases { command } => releases::run(ctx, command).await,
            Command::Batch { command } => batch::run(ctx, command).await,
            Command::Reserve(args) => reservations::reserve(ctx, args).await,
            Command::Release(args) => reservations::release(ctx, args).await,
            Command::Extend(args) => reservations::extend(ctx, args).await,
            Command::Reservations { command } => reservations::run(ctx, command).await,
            Command::Capacity(args) => reservations::capacity(ctx, args).await,
            Command::Quotas { command } => reservations::quotas(ctx, command).await,
            Command::Usage { command } => usage::run(ctx, command).await,
            Command::Fleet { command } => fleet::run(ctx, command).await,
            Command::Flavors { command } => flavors::run(ctx, command).await,
            Command::Images { command } => flavors::images(ctx, command).await,
            Command::Rollouts { command } => rollouts::run(ctx, command).await,
            Command::Instances { command } => instances::run(ctx, command).await,
            Command::Sandbox { command } => sandboxes::run(ctx, command).await,
            Command::SandboxTemplate { command } => sandboxes::run_template(ctx, command).await,
            Command::SandboxVolume { command } => sandboxes::run_volume(ctx, command).await,
            Command::SandboxSnapshot { command } => sandboxes::run_snapshot(ctx, command).await,
            Command::Metal { command } => metal::run(ctx, command).await,
            Command::Workflows { command } => metal::workflows(ctx, command).await,
            Command::Auth { command } => auth::run(ctx, command).await,
            Command::Secrets { command } => secrets::run(ctx, command).await,
            Command::Sites { command } => catalogue::sites(ctx, command).await,
            Command::Projects { command } => catalogue::projects(ctx, command).await,
            Command::Webhooks { command } => webhooks::run(ctx, command).await,
            Command::SshCert(args) => ssh_cert::run(ctx, args).await,
            Command::Console(args) => console::run(ctx, args).await,
            Command::Exec(args) => exec::run(ctx, args).await,
            Command::Forward(args) => forward::run(ctx, args).await,
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

    /// Sends `method` with `body`, under `key` when it is a create.
    pub async fn call(&self, method: &str, body: Map<String, Value>, key: Option<&str>) -> Result<Value, CliError> {
        self.client()?.call(method, &Value::Object(body), key).await
    }

    /// Sends a create method under the user's `--key`, or a fresh key, printed so a retry can
    /// reuse it (see [`idempotency_key`]).
    pub async fn create(&self, method: &str, body: Map<String, Value>, key: &IdempotencyKey) -> Result<Value, CliError> {
        let c = self.client()?;
        let key = idempotency_key(&key.key);
        c.call(method, &Value::Object(body), Some(&key)).await
    }

    /// Sends a list method for `page` and prints the rows as a table of `columns` (see
    /// [`Self::print_list`]).
    pub async fn list(
        &self,
        method: &str,
        mut body: Map<String, Value>,
        page: &Page,
        columns: &[Column],
    ) -> Result<(), CliError> {
        add_page(&mut body, page);
        let rows = self.call(method, body, None).await?;
        self.print_list(&rows, columns)
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

/// Puts `--if-version`, when it is given, as `ifVersion`.
pub fn add_if_version(body: &mut Map<String, Value>, if_version: &IfVersion) {
    if let Some(v) = if_version.if_version {
        body.insert("ifVersion".into(), json!(v));
    }
}

/// Puts the id `text` as `field`, its kind checked first (`what` names it in the error).
pub fn put_id<T: std::str::FromStr<Err = bc_core::Error>>(
    body: &mut Map<String, Value>,
    field: &str,
    what: &str,
    text: &str,
) -> Result<(), CliError> {
    body.insert(field.into(), json!(check_id::<T>(what, text)?));
    Ok(())
}

/// `--image`: an image by id (`img_…`, sent as `imageId`) or by channel (`NAME@stable`,
/// `NAME@testing`, sent as `image`), checked before anything is sent (a usage error, exit 2).
pub fn put_image(body: &mut Map<String, Value>, text: &str) -> Result<(), CliError> {
    if text.contains('@') {
        bc_projections::decide::image::parse_channel_ref(text).map_err(|e| CliError::usage(format!("--image: {e}")))?;
        body.insert("image".into(), json!(text));
        return Ok(());
    }
    put_id::<bc_core::id::ImageId>(body, "imageId", "--image", text)
}

/// How `--wait` follows a resource after a change: what it reads again, how often, when it
/// has settled, and what it says when the wait runs out.
pub struct Settle {
    /// The get method, and the id field it takes from the resource.
    pub get: &'static str,
    pub id_field: &'static str,
    pub poll_ms: u64,
    /// The progress line while the resource has not settled; `None` once it has.
    pub progress: fn(&Value) -> Option<String>,
    /// The error when it has not settled after `wait_s` seconds.
    pub timed_out: fn(&Value, u64) -> CliError,
}

impl Settle {
    /// Follows `resource` until it settles, showing each new progress line on stderr, or until
    /// `wait_s` seconds pass (then exit 1 with the resource as it stands printed). `0`: no wait.
    pub async fn follow(&self, ctx: &Context, c: &Client, mut resource: Value, wait_s: u64) -> Result<Value, CliError> {
        if wait_s == 0 {
            return Ok(resource);
        }
        let deadline = Instant::now() + Duration::from_secs(wait_s);
        let mut shown = String::new();
        loop {
            let Some(line) = (self.progress)(&resource) else { return Ok(resource) };
            if line != shown {
                eprintln!("{line}…");
                shown = line;
            }
            if Instant::now() >= deadline {
                ctx.print(&resource, Format::Json)?;
                return Err((self.timed_out)(&resource, wait_s));
            }
            tokio::time::sleep(Duration::from_millis(self.poll_ms)).await;
            let mut get = ctx.tenant_body()?;
            get.insert(self.id_field.into(), resource[self.id_field].clone());
            resource = c.call(self.get, &Value::Object(get), None).await?;
        }
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
