//! Webhooks in `sim run`: the workload's subscriptions, their in-memory receivers, and the real
//! `webhooks` consumer (`bc_reconcilers::webhooks`: fan-out, claim, the Standard Webhooks
//! signature, the retry schedule, the dead letter) driven on the virtual clock.
//!
//! - **Subscriptions**: each tenant subscribes 1 or 2 receivers at the start, and may add one
//!   in the middle of the run (a tenant's action, up to [`SUBSCRIPTIONS_PER_TENANT_RUN_MAX`]),
//!   as `webhooks.create` does (the signing secret stored first, then `webhook.created` on the
//!   webhook's stream), with type patterns drawn from [`PATTERNS`] and a secret from the seed.
//! - **Receivers** ([`Receivers`], the consumer's [`Sender`]) check every delivery's signature
//!   under the subscription's secret at the virtual clock's time, count each `webhook-id` they
//!   take, and answer 204; while `failing-receivers` has one down they answer 503 or refuse the
//!   connection.
//! - **Delivery** ([`SimWebhooks::drive`]), at every reconciler pass: `outbox::fan_out_step` until
//!   the cursor is at the log's end, then `work_claim`, `outbox::attempt` and
//!   `work_complete_many` for what is due, on [`RETRY`]'s schedule (its jitter from the seed).
//! - **Invariant** ([`SimWebhooks::check`]): every event a subscription matches (of its tenant, after
//!   its `webhook.created`, by its patterns) and the fan-out has passed has exactly its work
//!   item, and no other item exists; a done item's event reached its receiver; a dead one has a
//!   reason and used all its attempts; a receiver took only what its subscription matches and
//!   never a bad signature. At the end, nothing is left pending or unfanned.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use base64::Engine;
use bc_agent::session::{Rng, SeededRng};
use bc_core::clock::{Clock, ManualClock};
use bc_core::event::Position;
use bc_core::id::{TenantId, WebhookId};
use bc_core::store::outbox::{Completion, WorkState};
use bc_core::store::{AppendRequest, ExpectedVersion, NewEvent};
use bc_core::webhook::{EndpointPolicy, Secret};
use bc_projections::events::{self as ev, TypeFilter};
use bc_projections::{KIND_WEBHOOK, new_webhook_secret_id, stream_of, webhook_delivery_id};
use bc_reconcilers::outbox::{self, RetryPolicy, RunnerConfig};
use bc_reconcilers::webhooks::{CONSUMER, Delivery, Sender, Sent, Webhooks};

use crate::world::{Violation, World, pick, seed_bytes};

/// The patterns a subscription draws from (one or two of them).
pub const PATTERNS: &[&str] = &["reservation.*", "node.*", "gpu.*", "*", "reservation.activated"];
/// Subscriptions per tenant at the start: 1 to this many.
pub const SUBSCRIPTIONS_PER_TENANT_MAX: usize = 2;
/// Subscriptions per tenant once some are made in the middle of the run.
pub const SUBSCRIPTIONS_PER_TENANT_RUN_MAX: usize = 3;
/// The simulator's retry schedule: 2 s, 6 s, 18 s, 54 s, 60 s (±20 %), dead after the 6th
/// attempt, about 2.3 minutes after the first (the production schedule's 7.5 hours would
/// outlast any run).
pub const RETRY: RetryPolicy = RetryPolicy { base_ms: 2_000, factor: 3, max_delay_ms: 60_000, attempts_max: 6, jitter: 0.2 };
/// The longest one retry waits, with its jitter: after the faults stop, a pending delivery is
/// attempted again within this and the next pass.
pub const RETRY_WAIT_MAX_MS: u64 = RETRY.max_delay_ms + RETRY.max_delay_ms / 5;
/// A `failing-receivers` window: one receiver down for 10 s to 4 minutes (longer than the
/// schedule: some deliveries die).
pub const FAILING_MS_MIN: u64 = 10_000;
pub const FAILING_MS_MAX: u64 = 240_000;
/// Items claimed at once.
const CLAIM_MAX: u32 = 256;
/// Items read per page when checking.
const LIST_PAGE: u32 = 1_000;
/// The fan-out's and the claims' lease: longer than any step (the clock does not move in one).
const LEASE_MS: u64 = 60_000;
const OWNER: &str = "sim-webhooks";

/// One subscription, as the workload made it.
#[derive(Clone, Debug)]
pub struct Subscription {
    pub tenant: TenantId,
    pub webhook_id: String,
    pub url: String,
    pub created_seq: u64,
    pub filter: TypeFilter,
}

/// One receiver: the subscription's secret, whether it is down, and what it took.
#[derive(Debug)]
struct Receiver {
    secret: Secret,
    failing_until_ms: u64,
    /// Down as a refused connection (else as a 503).
    refusing: bool,
    /// `webhook-id` → how often it came.
    got: BTreeMap<String, u32>,
}

/// The in-memory receivers, by URL: the consumer's [`Sender`] in the simulator.
pub struct Receivers {
    clock: Arc<ManualClock>,
    by_url: Mutex<BTreeMap<String, Receiver>>,
    /// The first delivery a receiver refused as badly signed or malformed.
    bad: Mutex<Option<String>>,
}

#[async_trait]
impl Sender for Receivers {
    async fn send(&self, delivery: Delivery<'_>) -> Sent {
        let now_ms = self.clock.now_ms();
        let mut by_url = self.by_url.lock().expect("not poisoned");
        let Some(receiver) = by_url.get_mut(delivery.url) else {
            return Sent::Failed { error: "dns error: no such host".into(), refused: false };
        };
        if now_ms < receiver.failing_until_ms {
            return if receiver.refusing {
                Sent::Failed { error: "error sending request: client error (Connect): connection refused".into(), refused: false }
            } else {
                Sent::Answered(503)
            };
        }
        let header = |name: &str| delivery.headers.iter().find(|(n, _)| *n == name).map(|(_, v)| *v).unwrap_or_default();
        let (id, signature) = (header("webhook-id"), header("webhook-signature"));
        let timestamp_s: u64 = header("webhook-timestamp").parse().unwrap_or_default();
        let signed =
            bc_core::webhook::verify(&receiver.secret, id, timestamp_s, delivery.body.as_bytes(), signature, now_ms / 1000);
        let body: serde_json::Value = serde_json::from_str(delivery.body).unwrap_or_default();
        let shaped = header("content-type") == "application/json" && body["data"]["id"].as_str() == Some(id);
        if !signed || !shaped {
            let mut bad = self.bad.lock().expect("not poisoned");
            bad.get_or_insert_with(|| {
                format!("receiver {} refused delivery {id:?}: signature verifies {signed}, body names it {shaped}", delivery.url)
            });
            return Sent::Answered(400);
        }
        *receiver.got.entry(id.to_owned()).or_default() += 1;
        Sent::Answered(204)
    }
}

/// What the deliveries came to, for the outcome.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WebhookCounts {
    pub subscriptions: u64,
    /// Of those, made in the middle of the run.
    pub subscribed_mid_run: u64,
    /// Attempts made, and those the receiver took (duplicates included).
    pub attempts: u64,
    pub received: u64,
    /// Items done and dead at the last check.
    pub delivered: u64,
    pub dead: u64,
    /// Matched events the last check found (one item each).
    pub matched: u64,
}

/// Tenant `t`'s subscription number `n`, made as `webhooks.create` makes one: the secret
/// stored, then `webhook.created`; its patterns and secret drawn from `rng`, and its receiver
/// up. `None`: the fault failed its commit.
async fn subscribe(world: &World, rng: &mut SeededRng, receivers: &Receivers, t: usize, n: usize) -> Option<Subscription> {
    let tenant = &world.tenants[t];
    let mut patterns = vec![PATTERNS[pick(rng, PATTERNS.len())].to_owned()];
    if rng.next_unit() < 0.5 {
        patterns.push(PATTERNS[pick(rng, PATTERNS.len())].to_owned());
    }
    let secret = Secret::parse(&format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode(&seed_bytes(rng)[..24])))
        .expect("a secret");
    let id = WebhookId::from_ulid(world.log.ids.ulid()).to_string();
    let url = format!("https://hooks-{t}-{n}.sim.example/compute");
    let secret_id = new_webhook_secret_id(&id, world.log.ids.ulid());
    world.store.secret_put(tenant.id, &secret_id, &secret.expose(), world.now_ms()).await.expect("the secret is stored");
    let payload = ev::to_cbor(&ev::WebhookCreated {
        url: url.clone(),
        event_types: patterns.clone(),
        description: String::new(),
        secret_version: 1,
        secret_id,
        secret_ref: None,
    })
    .expect("cbor");
    let request = AppendRequest::new(
        tenant.id,
        stream_of(KIND_WEBHOOK, &id),
        ExpectedVersion::NoStream,
        "sim",
        vec![NewEvent::new(ev::WEBHOOK_CREATED, payload)],
    );
    // A commit the `failing-commits` fault fails leaves the secret without its webhook, as a
    // failed `webhooks.create` does; one whose answer a `failover` lost is asked again under its
    // key, and the replay says it was made.
    let appended = match world.append_as_client(request, format!("sim:webhooks.create:{id}")).await {
        Ok((Ok(appended), _)) => appended,
        Ok((Err(e), _)) if crate::world::injected(&e) => return None,
        Ok((Err(e), _)) => panic!("the webhook is created: {e}"),
        Err(broken) => panic!("the webhook is created: {broken}"),
    };
    let created_seq = appended.events[0].envelope.seq;
    let filter = TypeFilter::parse(&patterns).expect("the patterns parse");
    let receiver = Receiver { secret, failing_until_ms: 0, refusing: false, got: BTreeMap::new() };
    receivers.by_url.lock().expect("not poisoned").insert(url.clone(), receiver);
    Some(Subscription { tenant: tenant.id, webhook_id: id, url, created_seq, filter })
}

/// The subscriptions, the receivers and the consumer.
pub struct SimWebhooks {
    pub subscriptions: Vec<Subscription>,
    receivers: Arc<Receivers>,
    consumer: Webhooks,
    config: RunnerConfig,
    /// The retry schedule's jitter, from the seed.
    rng: std::sync::Mutex<rand::rngs::StdRng>,
    pub counts: WebhookCounts,
}

impl SimWebhooks {
    /// Each tenant subscribes 1 to [`SUBSCRIPTIONS_PER_TENANT_MAX`] receivers, as
    /// `webhooks.create` does: the secret stored, then `webhook.created`.
    pub async fn new(world: &World, rng: &mut SeededRng) -> SimWebhooks {
        use rand::SeedableRng;
        let receivers = Arc::new(Receivers { clock: world.clock.clone(), by_url: Mutex::default(), bad: Mutex::default() });
        let mut config = RunnerConfig::new(world.clock.clone());
        config.owner = OWNER.into();
        config.lease_ms = LEASE_MS;
        config.retry = RETRY;
        config.seed = u64::from_be_bytes(seed_bytes(rng)[..8].try_into().expect("8 bytes"));
        let mut subscriptions = Vec::new();
        for t in 0..world.tenants.len() {
            for n in 0..1 + pick(rng, SUBSCRIPTIONS_PER_TENANT_MAX) {
                subscriptions.push(subscribe(world, rng, &receivers, t, n).await.expect("no fault runs before the start"));
            }
        }
        let counts = WebhookCounts { subscriptions: subscriptions.len() as u64, ..WebhookCounts::default() };
        let rng = std::sync::Mutex::new(rand::rngs::StdRng::seed_from_u64(config.seed));
        // Any URL the subscriptions use passes the policy's check (names, not addresses): the
        // receivers stand where DNS and TCP would.
        let consumer = Webhooks::with_sender(EndpointPolicy::default(), world.clock.clone(), receivers.clone());
        SimWebhooks { subscriptions, receivers, consumer, config, rng, counts }
    }

    /// Tenant `t` subscribes one more receiver in the middle of the run (while the fan-out may
    /// still be behind the log: it must deliver only what follows the `webhook.created`), up to
    /// [`SUBSCRIPTIONS_PER_TENANT_RUN_MAX`]. True if it did.
    pub async fn subscribe_more(&mut self, world: &World, rng: &mut SeededRng, t: usize) -> bool {
        let tenant = world.tenants[t].id;
        let n = self.subscriptions.iter().filter(|s| s.tenant == tenant).count();
        if n >= SUBSCRIPTIONS_PER_TENANT_RUN_MAX {
            return false;
        }
        let Some(subscription) = subscribe(world, rng, &self.receivers, t, n).await else { return false };
        self.subscriptions.push(subscription);
        self.counts.subscriptions += 1;
        self.counts.subscribed_mid_run += 1;
        true
    }

    /// `failing-receivers`: receiver `n` (mod their count) is down until `until_ms`, refusing
    /// connections or answering 503.
    pub fn fail(&self, n: usize, until_ms: u64, refusing: bool) {
        let Some(sub) = self.subscriptions.get(n % self.subscriptions.len().max(1)) else { return };
        if let Some(receiver) = self.receivers.by_url.lock().expect("not poisoned").get_mut(&sub.url) {
            receiver.failing_until_ms = receiver.failing_until_ms.max(until_ms);
            receiver.refusing = refusing;
        }
    }

    /// Every receiver is up (the liveness phase).
    pub fn heal(&self) {
        for receiver in self.receivers.by_url.lock().expect("not poisoned").values_mut() {
            receiver.failing_until_ms = 0;
        }
    }

    /// One round of the consumer: fan out to the log's end, then attempt what is due and
    /// record it. Returns whether anything moved. A failure a fault injected is left for the
    /// next round (the runner logs and polls again); any other is a finding.
    pub async fn drive(&mut self, world: &World) -> Result<bool, Violation> {
        let store = &*world.store;
        let mut moved = false;
        loop {
            match outbox::fan_out_step(store, &self.consumer, &self.config).await {
                Ok(Some(_)) => moved = true,
                Ok(None) => break,
                Err(e) if crate::world::injected(&e) => {
                    tracing::debug!(error = %e, "the webhooks fan-out failed by injection; the next round retries");
                    return Ok(moved);
                }
                Err(e) => return Err(Violation(format!("the webhooks fan-out failed: {e}"))),
            }
        }
        // Claim what is due, as the runner's work loop does (a claim of nothing writes nothing;
        // a count of the items first read every item the consumer ever had, each round).
        loop {
            let items = match store.work_claim(CONSUMER, OWNER, world.now_ms(), LEASE_MS, CLAIM_MAX).await {
                Ok(items) => items,
                Err(e) if crate::world::injected(&e) => return Ok(moved),
                Err(e) => return Err(Violation(format!("claiming webhook deliveries failed: {e}"))),
            };
            if items.is_empty() {
                return Ok(moved);
            }
            moved = true;
            let received_before = self.received();
            let mut done = Vec::with_capacity(items.len());
            let prepared = outbox::Consumer::prepare(&self.consumer, store, &items).await;
            for item in &items {
                let (attempt, outcome) = outbox::attempt(store, &self.consumer, &self.config, &self.rng, item, &prepared).await;
                done.push(Completion { tenant: item.tenant, id: item.id.clone(), attempt, outcome });
            }
            self.counts.attempts += items.len() as u64;
            self.counts.received += self.received() - received_before;
            match store.work_complete_many(CONSUMER, OWNER, &done).await {
                Ok(written) if written.iter().all(|w| *w) => {}
                Ok(_) => return Err(Violation("a webhook delivery's lease was lost within one step".into())),
                Err(e) if crate::world::injected(&e) => return Ok(moved),
                Err(e) => return Err(Violation(format!("recording webhook attempts failed: {e}"))),
            }
            if let Some(bad) = self.receivers.bad.lock().expect("not poisoned").clone() {
                return Err(Violation(bad));
            }
        }
    }

    fn received(&self) -> u64 {
        let by_url = self.receivers.by_url.lock().expect("not poisoned");
        by_url.values().flat_map(|r| r.got.values()).map(|n| u64::from(*n)).sum()
    }

    /// What keeps the deliveries from having settled (`None`: nothing): the fan-out behind the
    /// log's end, or items still pending (claimed or waiting for their next attempt).
    pub async fn unsettled(&self, world: &World) -> Option<String> {
        let store = &*world.store;
        let cursor = store.cursor_position(CONSUMER).await.expect("the cursor reads");
        let behind = match cursor {
            Some(at) => store
                .read_after_rows(at, None, 1)
                .await
                .expect("the log reads")
                .first()
                .map(|e| format!("{} ({}, commit {})", e.event_type, e.tenant, e.commit)),
            None => Some("the log's first event".to_owned()),
        };
        if let Some(next) = behind {
            let at = cursor.map_or_else(|| "its start".to_owned(), |c| c.to_string());
            return Some(format!("webhook deliveries are still pending: the fan-out is at {at}, behind the event at {next}"));
        }
        let (pending, done, dead) = store.work_counts(CONSUMER).await.expect("the counts read");
        (pending > 0).then(|| format!("webhook deliveries are still pending: {pending} items ({done} done, {dead} dead)"))
    }

    /// The invariant over `events` (every event in the log: tenant, seq, id, type, position);
    /// `end`: nothing may be pending or unfanned any more.
    pub async fn check(&mut self, world: &World, events: &[LoggedEvent], end: bool) -> Result<(), Violation> {
        let store = &*world.store;
        let cursor = store.cursor_position(CONSUMER).await.expect("the cursor reads").unwrap_or(Position::START);
        if end && events.iter().any(|e| e.position > cursor) {
            return Err(Violation(format!("webhooks: the fan-out stopped at {cursor}, before the log's end")));
        }
        // What each receiver took, read once (the lock is not held across the reads below).
        let taken: BTreeMap<String, BTreeMap<String, u32>> = {
            let by_url = self.receivers.by_url.lock().expect("not poisoned");
            by_url.iter().map(|(url, r)| (url.clone(), r.got.clone())).collect()
        };
        let (mut delivered, mut dead, mut matched) = (0, 0, 0);
        for sub in &self.subscriptions {
            let expected: BTreeSet<&str> = events
                .iter()
                .filter(|e| e.tenant == sub.tenant && e.seq > sub.created_seq && e.event_type != ev::WEBHOOK_PINGED)
                .filter(|e| sub.filter.matches(&e.event_type) && e.position <= cursor)
                .map(|e| e.id.as_str())
                .collect();
            let mut items = BTreeMap::new();
            let mut before: Option<String> = None;
            loop {
                let page = store
                    .work_list(CONSUMER, sub.tenant, &sub.webhook_id, None, before.as_deref(), LIST_PAGE)
                    .await
                    .expect("the items read");
                let full = page.len() == LIST_PAGE as usize;
                before = page.last().map(|i| i.id.clone());
                items.extend(page.into_iter().map(|i| (i.id.clone(), i)));
                if !full {
                    break;
                }
            }
            let got = taken.get(&sub.url).expect("a receiver per subscription");
            for id in &expected {
                let key = webhook_delivery_id(id, &sub.webhook_id);
                let Some(item) = items.remove(&key) else {
                    return Err(Violation(format!("webhooks: event {id} matches {} but has no delivery", sub.webhook_id)));
                };
                match item.state {
                    WorkState::Done if got.contains_key(*id) => delivered += 1,
                    WorkState::Done => {
                        return Err(Violation(format!("webhooks: delivery {key} is done but its receiver never took it")));
                    }
                    WorkState::Dead
                        if item.last_error.as_deref().is_some_and(|e| !e.is_empty())
                            && item.round_attempts >= RETRY.attempts_max =>
                    {
                        dead += 1
                    }
                    WorkState::Dead => {
                        return Err(Violation(format!(
                            "webhooks: delivery {key} is dead after {} attempts, reason {:?}",
                            item.round_attempts, item.last_error
                        )));
                    }
                    WorkState::Pending if end => {
                        return Err(Violation(format!("webhooks: delivery {key} is still pending at the end")));
                    }
                    WorkState::Pending => {}
                }
            }
            if let Some(extra) = items.keys().next() {
                return Err(Violation(format!("webhooks: delivery {extra} is for an event {} does not match", sub.webhook_id)));
            }
            if let Some(stray) = got.keys().find(|id| !expected.contains(id.as_str())) {
                return Err(Violation(format!(
                    "webhooks: receiver {} took {stray}, which its subscription does not match",
                    sub.url
                )));
            }
            matched += expected.len() as u64;
        }
        self.counts.delivered = delivered;
        self.counts.dead = dead;
        self.counts.matched = matched;
        Ok(())
    }
}

/// One event of the log, as the webhooks' check reads it.
#[derive(Clone, Debug)]
pub struct LoggedEvent {
    pub tenant: TenantId,
    pub seq: u64,
    pub id: String,
    pub event_type: String,
    pub position: Position,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::world::Shape;

    /// The log's events as the full check lists them.
    async fn logged(world: &World) -> Vec<LoggedEvent> {
        let mut fold = crate::run::LogFold::default();
        crate::run::full_check_on(world, false, &mut fold).await.expect("the world is sound");
        fold.logged
    }

    #[tokio::test]
    async fn a_delivery_its_receiver_never_took_a_stray_one_and_a_missing_one_are_named() {
        // The first seed whose subscriptions take `reservation.requested`.
        let (world, mut hooks) = {
            let mut found = None;
            for seed in 1..40 {
                let mut rng = SeededRng(seed);
                let shape = Shape { tenants: 1, nodes: 1, gpus_min: 4, gpus_max: 4 };
                let world = World::new(seed, &mut rng, shape).await;
                let hooks = SimWebhooks::new(&world, &mut rng).await;
                if hooks.subscriptions.iter().any(|s| s.filter.matches(ev::RESERVATION_REQUESTED)) {
                    found = Some((world, hooks));
                    break;
                }
            }
            found.expect("a seed subscribes to reservation.requested")
        };
        let requested = world.request(0, 1, 300).await;
        assert!(hooks.drive(&world).await.expect("the round runs"), "the request fanned out and went");
        let events = logged(&world).await;
        hooks.check(&world, &events, true).await.expect("every matched event was delivered");
        assert!(hooks.counts.delivered > 0 && hooks.counts.delivered == hooks.counts.matched, "{:?}", hooks.counts);
        let event_id = events.iter().find(|e| e.event_type == ev::RESERVATION_REQUESTED).expect("the request").id.clone();
        let url = hooks.subscriptions.iter().find(|s| s.filter.matches(ev::RESERVATION_REQUESTED)).unwrap().url.clone();
        let took = |hooks: &SimWebhooks, id: &str, n: Option<u32>| {
            let mut by_url = hooks.receivers.by_url.lock().unwrap();
            let got = &mut by_url.get_mut(&url).unwrap().got;
            match n {
                Some(n) => got.insert(id.to_owned(), n),
                None => got.remove(id),
            }
        };

        // A receiver that answered 204 but never took it.
        let n = took(&hooks, &event_id, None).expect("it took the event");
        let what = hooks.check(&world, &events, true).await.unwrap_err().0;
        assert!(what.contains("never took it"), "{what}");
        took(&hooks, &event_id, Some(n));

        // A receiver that took an event its subscription does not match.
        took(&hooks, &requested, Some(1));
        let what = hooks.check(&world, &events, true).await.unwrap_err().0;
        assert!(what.contains("does not match"), "{what}");
        took(&hooks, &requested, None);

        // A matched event whose delivery is gone.
        world.store.work_prune(CONSUMER, world.now_ms() + 1, 1000).await.expect("pruned");
        let what = hooks.check(&world, &events, true).await.unwrap_err().0;
        assert!(what.contains("has no delivery"), "{what}");
    }

    #[tokio::test]
    async fn a_failing_receiver_is_retried_on_the_schedule_then_its_delivery_dies_with_a_reason() {
        let mut rng = SeededRng(3);
        let shape = Shape { tenants: 1, nodes: 1, gpus_min: 4, gpus_max: 4 };
        let world = World::new(3, &mut rng, shape).await;
        let mut hooks = SimWebhooks::new(&world, &mut rng).await;
        for n in 0..hooks.subscriptions.len() {
            hooks.fail(n, u64::MAX, n % 2 == 0);
        }
        // Whatever the request matched must die after RETRY.attempts_max attempts.
        world.request(0, 1, 300).await;
        for _ in 0..2 * RETRY.attempts_max {
            hooks.drive(&world).await.expect("the round runs");
            world.clock.set_ms(world.now_ms() + RETRY_WAIT_MAX_MS);
        }
        assert_eq!(hooks.unsettled(&world).await, None, "nothing is pending after the last attempt");
        let events = logged(&world).await;
        hooks.check(&world, &events, true).await.expect("dead letters with their reason settle the invariant");
        assert!(hooks.counts.matched > 0 && hooks.counts.delivered == 0, "{:?}", hooks.counts);
        assert_eq!(hooks.counts.dead, hooks.counts.matched, "{:?}", hooks.counts);
        assert_eq!(hooks.counts.attempts, hooks.counts.matched * u64::from(RETRY.attempts_max), "{:?}", hooks.counts);
    }
}
