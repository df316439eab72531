//! The `webhooks` consumer: signed deliveries of a tenant's events to its subscriptions.
//!
//! Fan-out makes one item per (event, webhook) for every webhook of the event's tenant created
//! before the event (`createdSeq < seq`) whose patterns match its type; `webhook.pinged` goes to
//! its own webhook only. The item keeps the exact body, so every retry sends the same bytes
//! under the same `webhook-id` (the event id), signed afresh with the attempt's timestamp.
//!
//! The webhook's document and signing secrets are read once per claimed batch (`prepare`),
//! right after the claim, and shared by the batch's deliveries to it.
//!
//! Delivery: `POST` with a 10 s timeout, no redirects, no proxy, and a resolver that connects
//! only to addresses the deployment's [`EndpointPolicy`] admits, checked at delivery time (a
//! name that resolved to a public address when saved cannot later point inside). The name
//! lookup itself is a [`Resolver`]: the system's ([`SystemResolver`]) in the binaries, one the
//! test controls in the tests, so the policy's check runs on names as well as on IP literals. 2xx is done;
//! anything else is retried on the runner's schedule; a refused address, a deleted webhook or a
//! missing secret is dead at once.
//!
//! A webhook that names a secret (`secretRef`, `secret://TENANT/sec_…`) signs with that secret's
//! current version, read when the batch is prepared. The resolution is the control plane's
//! alone and is recorded: the first time a webhook signs with a version, this consumer appends
//! `secret.resolved` (the referrer and the version, never the value) under an idempotency key of
//! the three, so each is in the log once, before any delivery signed with it is sent; a
//! resolution that cannot be recorded is not used (the deliveries are retried).
//!
//! The request goes out through a [`Sender`]: [`HttpSender`] (reqwest, the above) in the
//! binaries, an in-memory receiver in the simulator, which drives this consumer on its virtual
//! clock; everything before the send (the document, the policy's URL check, the secrets, the
//! Standard Webhooks headers) and the reading of the answer is the same code either way.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bc_core::clock::{Clock, rfc3339_ms};
use bc_core::event::{EventRow, StoredEvent};
use bc_core::id::TenantId;
use bc_core::store::outbox::{NewWorkItem, WorkItem};
use bc_core::store::{AppendRequest, EventStore, ExpectedVersion, Log, NewEvent, decode_row};
use bc_core::webhook::{EndpointPolicy, Secret, signature_header};
use bc_core::{Error, Result};
use bc_projections::events::{TypeFilter, WEBHOOK_PINGED};
use bc_projections::{KIND_WEBHOOK, SecretDoc, WebhookDoc, event_view};
use serde_json::json;

use crate::outbox::{Consumer, Handled, Prepared};

pub use bc_projections::WEBHOOK_CONSUMER as CONSUMER;
/// One delivery's time limit (connect, send, answer) by default; the lease must be at least
/// twice the limit in use.
pub const DELIVERY_TIMEOUT_MS: u64 = 10_000;

pub struct Webhooks {
    sender: Arc<dyn Sender>,
    policy: EndpointPolicy,
    clock: Arc<dyn Clock>,
    /// Where resolutions of secret references are recorded (`secret.resolved`); without one
    /// (the simulator, the benches) a webhook that names a secret is not delivered.
    log: Option<Arc<Log>>,
    /// Resolutions recorded by this process (`referrer:secret:version`), so each is appended
    /// once rather than replayed for every batch; at most [`RESOLUTIONS_REMEMBERED_MAX`].
    recorded: std::sync::Mutex<HashSet<String>>,
}

/// Resolutions a consumer remembers having recorded; past this it forgets them all (the next
/// append of each is an idempotent replay that appends nothing).
pub const RESOLUTIONS_REMEMBERED_MAX: usize = 10_000;
/// Who appends `secret.resolved`.
const RESOLVER_ACTOR: &str = "reconciler:webhooks";

/// One signed delivery, as the consumer sends it: `POST url` with these headers and body.
#[derive(Clone, Copy, Debug)]
pub struct Delivery<'a> {
    pub url: &'a str,
    /// `content-type`, `webhook-id`, `webhook-timestamp`, `webhook-signature`, in that order.
    pub headers: &'a [(&'static str, &'a str)],
    pub body: &'a str,
}

/// How a send went, before the consumer reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Sent {
    /// The receiver answered with this HTTP status.
    Answered(u16),
    /// No answer: `error` says why (the whole cause chain, without the URL); `refused`: the
    /// deployment's policy refused every address the name stands for (dead at once).
    Failed { error: String, refused: bool },
}

/// Sends one delivery: over HTTP in the binaries ([`HttpSender`]), to an in-memory receiver in
/// the simulator.
#[async_trait]
pub trait Sender: Send + Sync + 'static {
    async fn send(&self, delivery: Delivery<'_>) -> Sent;
}

/// The real sender: reqwest with the time limit, no redirects, no proxy, and names resolved
/// through the policy.
pub struct HttpSender {
    http: reqwest::Client,
    timeout_ms: u64,
}

#[async_trait]
impl Sender for HttpSender {
    async fn send(&self, delivery: Delivery<'_>) -> Sent {
        let mut request = self.http.post(delivery.url);
        for (name, value) in delivery.headers {
            request = request.header(*name, *value);
        }
        match request.body(delivery.body.to_owned()).send().await {
            Ok(response) => Sent::Answered(response.status().as_u16()),
            Err(e) => {
                // Without the URL: a receiver's URL may carry a token in its query.
                let e = e.without_url();
                let refused = error_chain(&e).any(|s| s.is::<Refused>());
                Sent::Failed { error: error_text(&e, self.timeout_ms), refused }
            }
        }
    }
}

/// Looks a receiver's host name up: every address it stands for, before the policy's check.
#[async_trait]
pub trait Resolver: Send + Sync + 'static {
    async fn lookup(&self, host: &str) -> std::io::Result<Vec<IpAddr>>;
}

/// The operating system's resolver (`getaddrinfo`).
pub struct SystemResolver;

#[async_trait]
impl Resolver for SystemResolver {
    async fn lookup(&self, host: &str) -> std::io::Result<Vec<IpAddr>> {
        Ok(tokio::net::lookup_host((host, 0)).await?.map(|a| a.ip()).collect())
    }
}

/// Resolves names for deliveries, keeping only addresses the policy admits.
struct PolicyResolver {
    policy: EndpointPolicy,
    resolver: Arc<dyn Resolver>,
}

impl reqwest::dns::Resolve for PolicyResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let policy = self.policy;
        let resolver = self.resolver.clone();
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let addrs: Vec<SocketAddr> = resolver.lookup(&host).await?.into_iter().map(|ip| SocketAddr::new(ip, 0)).collect();
            let admitted: Vec<SocketAddr> = addrs.iter().copied().filter(|a| policy.admits(a.ip()).is_ok()).collect();
            if admitted.is_empty() {
                // Which address it was stays in the operator's log: the tenant who saved the URL
                // learns only that it was refused, not what the name resolves to inside.
                tracing::warn!(host = %host, addresses = ?addrs, "a webhook receiver resolves only to refused addresses");
                return Err(Box::new(Refused) as Box<dyn std::error::Error + Send + Sync>);
            }
            Ok(Box::new(admitted.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

#[derive(Debug)]
struct Refused;

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the receiver's name resolves only to addresses this deployment does not deliver to")
    }
}

impl std::error::Error for Refused {}

impl Webhooks {
    /// `timeout_ms` bounds one delivery; keep the runner's lease well above it.
    pub fn new(policy: EndpointPolicy, timeout_ms: u64, clock: Arc<dyn Clock>) -> Result<Self> {
        Self::with_resolver(policy, timeout_ms, clock, Arc::new(SystemResolver))
    }

    /// [`Webhooks::new`] looking names up with `resolver`.
    pub fn with_resolver(
        policy: EndpointPolicy,
        timeout_ms: u64,
        clock: Arc<dyn Clock>,
        resolver: Arc<dyn Resolver>,
    ) -> Result<Self> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_millis(timeout_ms))
            .connect_timeout(Duration::from_millis(timeout_ms.div_ceil(2)))
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .user_agent(concat!("better-compute-webhooks/", env!("CARGO_PKG_VERSION")))
            .dns_resolver(Arc::new(PolicyResolver { policy, resolver }))
            .build()
            .map_err(|e| Error::Internal(format!("building the HTTP client: {e}")))?;
        Ok(Self::with_sender(policy, clock, Arc::new(HttpSender { http, timeout_ms })))
    }

    /// The consumer sending through `sender` (the simulator's in-memory receivers).
    pub fn with_sender(policy: EndpointPolicy, clock: Arc<dyn Clock>, sender: Arc<dyn Sender>) -> Self {
        Self { sender, policy, clock, log: None, recorded: std::sync::Mutex::new(HashSet::new()) }
    }

    /// This consumer recording each resolution of a secret reference in `log`, which webhooks
    /// that name a secret need.
    pub fn resolving_with(mut self, log: Arc<Log>) -> Self {
        self.log = Some(log);
        self
    }

    /// Records that `referrer` signs with version `secret.secret_version` of `secret` (once).
    async fn record_resolution(&self, tenant: TenantId, referrer: &str, secret: &SecretDoc) -> Result<()> {
        let key = format!("{referrer}:{}:{}", secret.secret_id, secret.secret_version);
        if self.recorded.lock().unwrap_or_else(std::sync::PoisonError::into_inner).contains(&key) {
            return Ok(());
        }
        let Some(log) = &self.log else {
            return Err(Error::Internal("this process records no secret resolutions".into()));
        };
        let payload = bc_projections::events::to_cbor(&bc_projections::events::SecretResolved {
            secret_id: secret.secret_id.clone(),
            secret_version: secret.secret_version,
            referrer: referrer.to_owned(),
        })?;
        let mut request = AppendRequest::new(
            tenant,
            bc_projections::stream_of(bc_projections::secret::KIND_SECRET_RESOLUTION, &secret.secret_id),
            ExpectedVersion::Any,
            RESOLVER_ACTOR,
            vec![NewEvent::new(bc_projections::events::SECRET_RESOLVED, payload)],
        );
        request.idempotency_key = Some(format!("secret_resolved:{key}"));
        log.append(request).await?;
        let mut recorded = self.recorded.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if recorded.len() >= RESOLUTIONS_REMEMBERED_MAX {
            recorded.clear();
        }
        recorded.insert(key);
        Ok(())
    }
}

/// The body of a delivery: `{type, timestamp, data}` (Standard Webhooks' payload shape), where
/// `data` is the event as `events.get` shows it without its bytes.
pub fn body_of(event: &StoredEvent) -> String {
    json!({
        "type": event.envelope.event_type,
        "timestamp": rfc3339_ms(event.envelope.at_ms),
        "data": event_view(event, false),
    })
    .to_string()
}

/// The signing secrets in use for a webhook now, each with the end of its overlap: the current
/// one (no end), and rotated-out ones while they are honoured.
pub async fn secrets_of(store: &dyn EventStore, webhook: &WebhookDoc, now_ms: u64) -> Result<Vec<(Secret, Option<u64>)>> {
    let tenant: TenantId = webhook.tenant_id.parse()?;
    if let Some(reference) = &webhook.secret_ref {
        let (_, secret) = resolve_secret_ref(store, tenant, reference).await?;
        return Ok(vec![(secret, None)]);
    }
    // A rotated-out secret whose overlap is over signs nothing again: its row goes (the next
    // rotation drops it from the document too).
    for expired in webhook.previous_secrets.iter().filter(|p| p.valid_until_ms <= now_ms) {
        store.secret_delete(tenant, &expired.secret_id).await?;
    }
    let mut ids = vec![(webhook.secret_id.as_str(), None)];
    ids.extend(
        webhook
            .previous_secrets
            .iter()
            .filter(|p| p.valid_until_ms > now_ms)
            .map(|p| (p.secret_id.as_str(), Some(p.valid_until_ms))),
    );
    let mut secrets = Vec::new();
    for (id, end) in ids {
        let text = store
            .secret_get(tenant, id)
            .await?
            .ok_or_else(|| Error::not_found(format!("signing secret {id} of {}", webhook.webhook_id)))?;
        secrets.push((Secret::parse(&text)?, end));
    }
    Ok(secrets)
}

/// The secret `reference` names, as `tenant` may use it: its document and its current value as
/// a signing secret. Another tenant's secret, or a deleted one, is not found; a value that is not
/// yet readable (a put in flight) is unavailable, so the delivery is retried.
pub async fn resolve_secret_ref(store: &dyn EventStore, tenant: TenantId, reference: &str) -> Result<(SecretDoc, Secret)> {
    let (owner, secret_id) = bc_projections::secret::parse_secret_ref(reference)?;
    if owner != tenant {
        return Err(Error::not_found(format!("secret {reference} in tenant {tenant}")));
    }
    let row = store
        .row_get(&tenant.to_string(), bc_projections::secret::KIND_SECRET, &secret_id.to_string())
        .await?
        .ok_or_else(|| Error::not_found(format!("secret {reference} (deleted)")))?;
    let doc: SecretDoc = serde_json::from_value(row.doc).map_err(|e| Error::Internal(format!("secret document: {e}")))?;
    let text = store
        .secret_get(tenant, &doc.value_id)
        .await?
        .ok_or_else(|| Error::Unavailable(format!("version {} of {reference} is not readable yet", doc.secret_version)))?;
    // The value's own text never goes into an error: only whether it parsed.
    let secret = Secret::parse(&text).map_err(|_| Error::InvalidArgument {
        message: format!("version {} of {reference} is not a webhook signing secret", doc.secret_version),
        hint: Some("put a whsec_ value (secrets put)".into()),
    })?;
    Ok((doc, secret))
}

/// A webhook's document (its URL admitted by the policy) and its signing secrets in use, or
/// how every delivery to it ends without a send (deleted, a refused URL, a missing secret, a
/// database hiccup).
type LookedUp = std::result::Result<Arc<(WebhookDoc, Vec<(Secret, Option<u64>)>)>, Handled>;

/// Webhooks a batch's `prepare` looks up at once.
const LOOKUPS_AT_ONCE: usize = 8;

/// What [`Webhooks`]' `prepare` reads for a claimed batch: each of its webhooks, looked up
/// once, however many of its deliveries the batch holds.
#[derive(Default)]
struct Batch(HashMap<(TenantId, String), LookedUp>);

impl Webhooks {
    /// Reads webhook `id` of `tenant` for a delivery: its document, the policy's check of its
    /// URL and its signing secrets in use now.
    async fn look_up(&self, store: &dyn EventStore, tenant: TenantId, id: &str) -> LookedUp {
        let webhook = match store.row_get(&tenant.to_string(), KIND_WEBHOOK, id).await {
            Ok(Some(row)) => match serde_json::from_value::<WebhookDoc>(row.doc) {
                Ok(doc) => doc,
                Err(e) => return Err(Handled::fatal(None, format!("webhook document: {e}"))),
            },
            Ok(None) => return Err(Handled::fatal(None, "the webhook was deleted")),
            Err(e) => return Err(Handled::retry(None, format!("reading the webhook: {}", e.public_message()))),
        };
        if let Err(e) = self.policy.check_url(&webhook.url) {
            return Err(Handled::fatal(None, e.to_string()));
        }
        if let Some(reference) = &webhook.secret_ref {
            let referrer = format!("{KIND_WEBHOOK}/{}", webhook.webhook_id);
            let resolved = match resolve_secret_ref(store, tenant, reference).await {
                Ok((doc, secret)) => match self.record_resolution(tenant, &referrer, &doc).await {
                    Ok(()) => secret,
                    Err(e) => {
                        return Err(Handled::retry(
                            None,
                            format!("recording the resolution of {reference}: {}", e.public_message()),
                        ));
                    }
                },
                Err(e @ (Error::NotFound { .. } | Error::InvalidArgument { .. })) => {
                    return Err(Handled::fatal(None, e.to_string()));
                }
                Err(e) => return Err(Handled::retry(None, e.public_message())),
            };
            return Ok(Arc::new((webhook, vec![(resolved, None)])));
        }
        let secrets = match secrets_of(store, &webhook, self.clock.now_ms()).await {
            // With each one's end, checked again when it signs.
            Ok(s) => s,
            // A missing or malformed secret stays so; a database hiccup does not.
            Err(e @ (Error::NotFound { .. } | Error::InvalidArgument { .. })) => return Err(Handled::fatal(None, e.to_string())),
            Err(e) => return Err(Handled::retry(None, e.public_message())),
        };
        Ok(Arc::new((webhook, secrets)))
    }
}

/// Rows of webhooks read per query while loading a tenant's subscriptions.
const WEBHOOK_ROWS_PER_READ: u32 = 500;

/// A tenant's webhooks with their parsed filters. A document or a pattern this version cannot
/// read (a newer writer's) is skipped with a warning: it matches nothing, never everything.
async fn subscriptions(store: &dyn EventStore, tenant: TenantId) -> Result<Vec<(WebhookDoc, TypeFilter)>> {
    let mut list = Vec::new();
    let mut after: Option<String> = None;
    let tenant_text = tenant.to_string();
    loop {
        // Decoded straight from the stored text, as `placement::all_rows` does.
        let rows = store.row_list_raw(&tenant_text, KIND_WEBHOOK, after.as_deref(), WEBHOOK_ROWS_PER_READ).await?;
        let full = rows.len() == WEBHOOK_ROWS_PER_READ as usize;
        after = rows.last().map(|r| r.key.id.clone());
        for row in rows {
            let id = row.key.id.clone();
            let doc: WebhookDoc = match serde_json::from_str(&row.doc) {
                Ok(doc) => doc,
                Err(e) => {
                    tracing::warn!(%tenant, webhook = %id, error = %e, "skipping a webhook document this version cannot read");
                    continue;
                }
            };
            match TypeFilter::parse(&doc.event_types) {
                Ok(filter) if !doc.event_types.is_empty() => list.push((doc, filter)),
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(%tenant, webhook = %id, error = %e, "skipping a webhook whose patterns this version cannot read")
                }
            }
        }
        if !full {
            return Ok(list);
        }
    }
}

#[async_trait]
impl Consumer for Webhooks {
    fn name(&self) -> &'static str {
        CONSUMER
    }

    async fn fan_out(&self, store: &dyn EventStore, rows: &[EventRow]) -> Result<Vec<NewWorkItem>> {
        let mut hooks: HashMap<String, Vec<(WebhookDoc, TypeFilter)>> = HashMap::new();
        let mut items = Vec::new();
        for row in rows {
            if !hooks.contains_key(&row.tenant) {
                let tenant: TenantId = row.tenant.parse()?;
                hooks.insert(row.tenant.clone(), subscriptions(store, tenant).await?);
            }
            // Which webhooks want it, from the row's columns; the event is decoded (and
            // checked) only when one does.
            let wanted: Vec<&WebhookDoc> = hooks[&row.tenant]
                .iter()
                .filter(|(hook, filter)| {
                    if row.event_type == WEBHOOK_PINGED {
                        row.stream == bc_projections::stream_of(KIND_WEBHOOK, &hook.webhook_id)
                    } else {
                        hook.created_seq < row.seq && filter.matches(&row.event_type)
                    }
                })
                .map(|(hook, _)| hook)
                .collect();
            if wanted.is_empty() {
                continue;
            }
            let event = decode_row(row.clone())?;
            let env = &event.envelope;
            let body = body_of(&event);
            for hook in wanted {
                items.push(NewWorkItem {
                    tenant: env.tenant,
                    id: bc_projections::webhook_delivery_id(&env.id, &hook.webhook_id),
                    subject: hook.webhook_id.clone(),
                    payload: json!({ "messageId": env.id.to_string(), "type": env.event_type, "body": body }),
                });
            }
        }
        Ok(items)
    }

    async fn prepare(&self, store: &dyn EventStore, items: &[WorkItem]) -> Prepared {
        use futures::StreamExt as _;
        let mut distinct: Vec<(TenantId, String)> = Vec::new();
        for item in items {
            if !distinct.iter().any(|(t, id)| *t == item.tenant && *id == item.subject) {
                distinct.push((item.tenant, item.subject.clone()));
            }
        }
        // A few webhooks at once, as the deliveries' own reads ran before.
        let looked: Vec<_> = futures::stream::iter(distinct)
            .map(|(tenant, id)| async move {
                let looked = self.look_up(store, tenant, &id).await;
                ((tenant, id), looked)
            })
            .buffered(LOOKUPS_AT_ONCE)
            .collect()
            .await;
        Some(Arc::new(Batch(looked.into_iter().collect())))
    }

    async fn handle(&self, store: &dyn EventStore, item: &WorkItem, prepared: &Prepared) -> Handled {
        let (Some(msg_id), Some(body)) = (item.payload["messageId"].as_str(), item.payload["body"].as_str()) else {
            return Handled::fatal(None, "malformed work item");
        };
        let batch = prepared.as_ref().and_then(|p| p.downcast_ref::<Batch>());
        let looked = match batch.and_then(|b| b.0.get(&(item.tenant, item.subject.clone()))) {
            Some(looked) => looked.clone(),
            None => self.look_up(store, item.tenant, &item.subject).await,
        };
        let found = match looked {
            Ok(found) => found,
            Err(handled) => return handled,
        };
        let webhook = &found.0;
        let now_ms = self.clock.now_ms();
        // A rotated-out secret whose overlap ended since the batch was prepared signs nothing.
        let secrets: Vec<Secret> =
            found.1.iter().filter(|(_, end)| end.is_none_or(|end| end > now_ms)).map(|(secret, _)| secret.clone()).collect();
        let timestamp = now_ms / 1000;
        let signature = signature_header(&secrets, msg_id, timestamp, body.as_bytes());
        let timestamp_text = timestamp.to_string();
        let headers = [
            ("content-type", "application/json"),
            ("webhook-id", msg_id),
            ("webhook-timestamp", timestamp_text.as_str()),
            ("webhook-signature", signature.as_str()),
        ];
        match self.sender.send(Delivery { url: &webhook.url, headers: &headers, body }).await {
            Sent::Answered(status) if (200..300).contains(&status) => Handled::ok(Some(status)),
            Sent::Answered(code) => {
                // As reqwest shows a status: `503 Service Unavailable`.
                let status = reqwest::StatusCode::from_u16(code).map(|s| s.to_string()).unwrap_or_else(|_| code.to_string());
                Handled::retry(Some(code), format!("the receiver answered {status}"))
            }
            Sent::Failed { error, refused: true } => Handled::fatal(None, error),
            Sent::Failed { error, refused: false } => Handled::retry(None, error),
        }
    }
}

fn error_chain<'a>(e: &'a (dyn std::error::Error + 'static)) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    std::iter::successors(Some(e), |e| e.source())
}

/// The whole cause chain of a transport error, for the attempt record.
fn error_text(e: &reqwest::Error, timeout_ms: u64) -> String {
    let causes: Vec<String> = error_chain(e).map(|c| c.to_string()).collect();
    let mut text = causes.join(": ");
    if e.is_timeout() {
        text = format!("timed out after {timeout_ms} ms: {text}");
    }
    text
}
