//! The `metal` reconciler on a virtual clock against fake BMCs: the whole lifecycle, each
//! misbehaving BMC ending in a named state with a reason within its bound, power drift, and a
//! reconciler restarted at every step of a deploy recording each transition once.
// Fixtures' ids (tenants, nodes, tokens) only name things; the clock is the manual one.
#![allow(clippy::disallowed_methods)]

use crate::support;

use std::sync::Arc;

use bc_bmc::PowerState;
use bc_bmc::fake::{FakeBmc, FakeConnector, Misbehaviour};
use bc_core::clock::ManualClock;
use bc_core::id::{JoinTokenId, NodeId, PoolId, TenantId, WorkflowId};
use bc_core::store::{AppendRequest, EventStore, ExpectedVersion, Log, NewEvent};
use bc_projections::decide::{self, VerbInput};
use bc_projections::events as ev;
use bc_projections::metal::{MetalState, POWER_DEADLINE_S, Verb, WAIT_DEADLINE_S};
use bc_projections::workflow::{KIND_METAL, MetalDoc, STEP_ATTEMPTS_MAX, UNAUTHORIZED_ATTEMPTS_MAX, WorkflowOutcome};
use bc_projections::{KIND_JOIN_TOKEN, stream_of};
use bc_reconcilers::metal::{DRIFT_READS, Metal};

const ADDRESS: &str = "https://bmc-1.example:8443";

struct World {
    _dir: tempfile::TempDir,
    store: Arc<dyn EventStore>,
    log: Arc<Log>,
    clock: Arc<ManualClock>,
    fake: FakeConnector,
    tenant: TenantId,
    node: String,
}

async fn world() -> World {
    let (dir, store, log, clock) = support::manual_log().await;
    let tenant = TenantId::generate();
    let node = NodeId::generate().to_string();
    support::enroll(&*store, &log, tenant, &node, "m1".into(), ADDRESS, "hunter2").await;
    World { _dir: dir, store, log, clock, fake: FakeConnector::default(), tenant, node }
}

impl World {
    fn reconciler(&self) -> Metal {
        let mut metal = Metal::new(self.log.clone(), self.clock.clone(), Arc::new(self.fake.clone()));
        metal.sync_interval_ms = 10_000;
        metal
    }

    fn bmc(&self) -> FakeBmc {
        self.fake.machine(ADDRESS)
    }

    async fn doc(&self) -> MetalDoc {
        let row = self.store.row_get(&self.tenant.to_string(), KIND_METAL, &self.node).await.unwrap().unwrap();
        serde_json::from_value(row.doc).unwrap()
    }

    async fn verb(&self, verb: Verb, image: Option<(&str, &str)>, token: Option<&str>, power: Option<&str>) -> MetalDoc {
        let doc = self.doc().await;
        let wf = WorkflowId::generate().to_string();
        let input =
            VerbInput { now_ms: self.clock.now(), workflow_id: &wf, image, join_token_id: token, power, if_version: None };
        let append = decide::metal_verb(&doc, verb, &input).unwrap_or_else(|e| panic!("{verb} in {}: {e}", doc.state));
        self.log.append(append.into_request(self.tenant, "test")).await.unwrap();
        self.doc().await
    }

    /// Passes a second of virtual time apart until no workflow runs (or `passes` ran).
    async fn settle(&self, metal: &Metal, passes: usize) -> MetalDoc {
        for _ in 0..passes {
            metal.pass().await.unwrap();
            if self.doc().await.running().is_none() {
                break;
            }
            self.clock.advance_ms(1_000);
        }
        self.doc().await
    }

    /// Manage, provide, then deploy (a token that is never spent) until the machine is in
    /// deploy-wait; returns when the deploy was asked for.
    async fn deploy_until_it_waits_for_its_agent(&self, metal: &Metal) -> u64 {
        self.verb(Verb::Manage, None, None, None).await;
        self.settle(metal, 10).await;
        self.verb(Verb::Provide, None, None, None).await;
        self.settle(metal, 20).await;
        let token = JoinTokenId::generate().to_string();
        let deployed_at = self.clock.now();
        self.verb(Verb::Deploy, Some(("img_x", "http://images.example/os.iso")), Some(&token), None).await;
        for _ in 0..20 {
            metal.pass().await.unwrap();
            self.clock.advance_ms(1_000);
        }
        assert_eq!(self.doc().await.state, MetalState::DeployWait);
        deployed_at
    }

    /// The running (or last) deploy's join token: whether it is revoked.
    async fn deploy_token_revoked(&self) -> bool {
        let doc = self.doc().await;
        let token = doc.workflow.and_then(|w| w.join_token_id).expect("a deploy's workflow names its token");
        let row = self.store.row_get(&self.tenant.to_string(), KIND_JOIN_TOKEN, &token).await.unwrap().unwrap();
        row.doc["revoked"].as_bool().unwrap()
    }

    /// The installed system's agent joins: the deploy's token is spent.
    async fn agent_joins(&self, token: &str) {
        let used = NewEvent::new(ev::JOIN_TOKEN_USED, ev::to_cbor(&ev::JoinTokenUsed { node_id: self.node.clone() }).unwrap());
        let stream = stream_of(KIND_JOIN_TOKEN, &token);
        let row = self.store.row_get(&self.tenant.to_string(), KIND_JOIN_TOKEN, token).await.unwrap().unwrap();
        let version = row.doc["version"].as_u64().unwrap();
        self.log
            .append(AppendRequest::new(self.tenant, stream, ExpectedVersion::Exact(version), "test", vec![used]))
            .await
            .unwrap();
    }

    async fn events(&self) -> Vec<bc_core::event::StoredEvent> {
        let rows = self.store.read_stream_rows(self.tenant, &stream_of(KIND_METAL, &self.node), 0, 10_000).await.unwrap();
        bc_core::store::decode_rows(rows).unwrap()
    }

    /// The machine's transitions, as `verb:from>to`, in log order.
    async fn transitions(&self) -> Vec<String> {
        self.events()
            .await
            .iter()
            .filter(|e| e.envelope.event_type == ev::METAL_TRANSITIONED)
            .map(|e| {
                let p = bc_core::canonical::to_json(&e.envelope.payload);
                format!("{}:{}>{}", p["verb"].as_str().unwrap(), p["from"].as_str().unwrap(), p["to"].as_str().unwrap())
            })
            .collect()
    }
}

trait Now {
    fn now(&self) -> u64;
}

impl Now for ManualClock {
    fn now(&self) -> u64 {
        bc_core::clock::Clock::now_ms(self)
    }
}

/// Enroll → manage → inspect → provide → deploy → (the agent joins) → active → undeploy →
/// available, every step against the fake BMC, every transition once.
#[tokio::test]
async fn the_lifecycle_runs_end_to_end_on_a_fake_bmc() {
    let w = world().await;
    let metal = w.reconciler();
    w.bmc().with(|s| s.power = Some(PowerState::On));

    w.verb(Verb::Manage, None, None, None).await;
    let doc = w.settle(&metal, 10).await;
    assert_eq!((doc.state, doc.power.as_deref()), (MetalState::Manageable, Some("on")), "{doc:#?}");

    w.verb(Verb::Inspect, None, None, None).await;
    let doc = w.settle(&metal, 10).await;
    assert_eq!(doc.state, MetalState::Manageable);
    assert_eq!(doc.inspection.as_ref().and_then(|i| i.memory_gib), Some(16), "{doc:#?}");

    w.verb(Verb::Provide, None, None, None).await;
    let doc = w.settle(&metal, 20).await;
    assert_eq!((doc.state, doc.power.as_deref()), (MetalState::Available, Some("off")), "{doc:#?}");

    let token = JoinTokenId::generate().to_string();
    w.verb(Verb::Deploy, Some(("img_x", "http://images.example/os.iso")), Some(&token), None).await;
    for _ in 0..20 {
        metal.pass().await.unwrap();
        w.clock.advance_ms(1_000);
    }
    let doc = w.doc().await;
    assert_eq!(doc.state, MetalState::DeployWait, "{doc:#?}");
    let bmc = w.bmc().with(|s| s.clone());
    assert_eq!(bmc.media_image.as_deref(), Some("http://images.example/os.iso"));
    assert_eq!(bmc.boot_overrides, vec![bc_bmc::BootSource::Cd], "the boot override is set once");
    assert_eq!(bmc.power, Some(PowerState::On));

    w.agent_joins(&token).await;
    let doc = w.settle(&metal, 5).await;
    assert_eq!((doc.state, doc.image_id.as_deref(), doc.last_error.as_deref()), (MetalState::Active, Some("img_x"), None));
    assert!(!w.deploy_token_revoked().await, "a deploy that succeeded revokes nothing");

    w.verb(Verb::Undeploy, None, None, None).await;
    let doc = w.settle(&metal, 30).await;
    assert_eq!((doc.state, doc.power.as_deref()), (MetalState::Available, Some("off")), "{doc:#?}");
    assert_eq!(w.bmc().with(|s| s.media_image.clone()), None);

    assert_eq!(
        w.transitions().await,
        [
            "manage:enroll>verifying",
            "done:verifying>manageable",
            "inspect:manageable>inspecting",
            "done:inspecting>manageable",
            "provide:manageable>cleaning",
            "done:cleaning>available",
            "deploy:available>deploying",
            "wait:deploying>deploy-wait",
            "done:deploy-wait>active",
            "undeploy:active>deleting",
            "done:deleting>cleaning",
            "done:cleaning>available",
        ]
    );
}

/// A BMC that answers 401: bounded retries, then maintenance with the reason; never a loop.
#[tokio::test]
async fn a_bmc_that_refuses_the_credentials_puts_the_machine_in_maintenance() {
    let w = world().await;
    let metal = w.reconciler();
    w.bmc().with(|s| s.misbehaviour = Misbehaviour::Unauthorized);
    w.verb(Verb::Manage, None, None, None).await;
    let doc = w.settle(&metal, 200).await;
    assert_eq!(doc.state, MetalState::Enroll, "{doc:#?}");
    let reason = doc.flags.maintenance.clone().expect("in maintenance");
    assert!(reason.contains("refused the credentials"), "{reason}");
    assert_eq!(doc.last_error.as_deref(), Some(reason.as_str()));
    assert_eq!(w.bmc().with(|s| s.calls.len()), UNAUTHORIZED_ATTEMPTS_MAX as usize, "exactly the bounded attempts");
    // In maintenance, only recover, abort and power are taken.
    let refused = decide::metal_verb(&doc, Verb::Manage, &VerbInput { now_ms: 0, workflow_id: "wf_x", ..Default::default() });
    assert_eq!(refused.unwrap_err().code(), bc_core::ErrorCode::InvalidState);
}

/// A machine at rest whose BMC starts answering 401 (its password changed behind our back): the
/// power sync reads it again a bounded number of times, then puts it into maintenance with the
/// reason, and reads it no more.
#[tokio::test]
async fn a_machine_at_rest_whose_bmc_starts_refusing_goes_into_maintenance_after_bounded_reads() {
    let w = world().await;
    let metal = w.reconciler();
    w.verb(Verb::Manage, None, None, None).await;
    let doc = w.settle(&metal, 10).await;
    assert_eq!((doc.state, doc.running().is_none()), (MetalState::Manageable, true));
    w.bmc().with(|s| {
        s.misbehaviour = Misbehaviour::Unauthorized;
        s.calls.clear();
    });
    for _ in 0..20 {
        w.clock.advance_ms(metal.sync_interval_ms);
        metal.pass().await.unwrap();
    }
    let doc = w.doc().await;
    let reason = doc.flags.maintenance.clone().expect("in maintenance");
    assert!(reason.contains(&format!("refused the credentials {UNAUTHORIZED_ATTEMPTS_MAX} times in a row")), "{reason}");
    assert_eq!(doc.state, MetalState::Manageable, "maintenance is a flag, not a state");
    assert_eq!(w.bmc().with(|s| s.calls.len()), UNAUTHORIZED_ATTEMPTS_MAX as usize, "bounded reads, then none");
    let set = w.events().await.iter().filter(|e| e.envelope.event_type == ev::METAL_MAINTENANCE_SET).count();
    assert_eq!(set, 1);
}

/// A machine whose stored TLS mode asks for a pin it does not have is refused, never connected
/// to without verification.
#[tokio::test]
async fn a_tls_mode_without_its_pin_fails_closed() {
    let w = world().await;
    let tampered = ev::MetalEnrolled {
        pool_id: PoolId::generate().to_string(),
        name: "m2".into(),
        site_id: None,
        bmc: ev::MetalBmc {
            address: "https://bmc-2.example:8443".into(),
            system_path: None,
            username: "admin".into(),
            tls: "pin".into(),
            ca_pem: None,
            pin: None,
            secret_id: "bmc_m2".into(),
        },
    };
    w.store.secret_put(w.tenant, "bmc_m2", "hunter2", 0).await.unwrap();
    let node = NodeId::generate().to_string();
    let event = NewEvent::new(ev::METAL_ENROLLED, ev::to_cbor(&tampered).unwrap());
    w.log
        .append(AppendRequest::new(w.tenant, stream_of(KIND_METAL, &node), ExpectedVersion::NoStream, "test", vec![event]))
        .await
        .unwrap();
    let w = World { node, ..w };
    let metal = w.reconciler();
    w.verb(Verb::Manage, None, None, None).await;
    let doc = w.settle(&metal, 200).await;
    assert_eq!(doc.state, MetalState::Enroll, "{doc:#?}");
    let error = doc.last_error.unwrap();
    assert!(error.contains("TLS mode \"pin\"") && error.contains("enroll it again"), "{error}");
    assert_eq!(w.fake.machine("https://bmc-2.example:8443").with(|s| s.calls.len()), 0, "never connected");
}

/// A BMC that takes the reset and never applies it: the power wait's own deadline.
#[tokio::test]
async fn a_bmc_that_never_applies_power_fails_the_clean_at_the_power_deadline() {
    let w = world().await;
    let metal = w.reconciler();
    w.bmc().with(|s| s.power = Some(PowerState::On));
    w.verb(Verb::Manage, None, None, None).await;
    w.settle(&metal, 10).await;
    w.bmc().with(|s| s.misbehaviour = Misbehaviour::PowerNeverApplies);
    let started = w.clock.now();
    w.verb(Verb::Provide, None, None, None).await;
    let doc = w.settle(&metal, 200).await;
    assert_eq!(doc.state, MetalState::CleanFailed, "{doc:#?}");
    let error = doc.last_error.clone().unwrap();
    assert!(error.contains("did not apply power off within 60 s"), "{error}");
    let took = w.clock.now() - started;
    assert!(took <= (POWER_DEADLINE_S + 5) * 1000, "failed {took} ms after the provide");
}

/// A pass that comes late (a slow BMC elsewhere held the one before it) finds a power wait
/// past its deadline: it looks once more, and a machine whose power was applied in the
/// meantime goes on instead of failing (regression: the deadline was checked before the poll).
#[tokio::test]
async fn a_late_pass_looks_once_more_before_it_fails_a_power_wait() {
    let w = world().await;
    let metal = w.reconciler();
    w.bmc().with(|s| s.power = Some(PowerState::On));
    w.verb(Verb::Manage, None, None, None).await;
    w.settle(&metal, 10).await;
    // Power applies at the second read after the reset: the wait's first poll says not yet.
    w.bmc().with(|s| s.power_lag_polls = 1);
    w.verb(Verb::Provide, None, None, None).await;
    let waiting =
        |doc: &MetalDoc| doc.running().and_then(|wf| wf.current()) == Some(bc_projections::workflow::Step::WaitPowerOff);
    for _ in 0..10 {
        if waiting(&w.doc().await) {
            break;
        }
        metal.pass().await.unwrap();
    }
    metal.pass().await.unwrap();
    assert!(waiting(&w.doc().await), "the first poll found the power not yet off");
    // The next pass comes only after the 60 s wait's deadline.
    w.clock.advance_ms((POWER_DEADLINE_S + 30) * 1000);
    let doc = w.settle(&metal, 20).await;
    assert_eq!(doc.state, MetalState::Available, "{doc:#?}");
    assert_eq!(doc.workflow.as_ref().unwrap().outcome, WorkflowOutcome::Succeeded);

    // A BMC that never applies it still fails at the deadline, after that one more look.
    w.bmc().with(|s| s.misbehaviour = Misbehaviour::PowerNeverApplies);
    w.verb(Verb::Deploy, Some(("img_x", "http://images.example/os.iso")), Some(&JoinTokenId::generate().to_string()), None).await;
    let doc = w.settle(&metal, 200).await;
    assert_eq!(doc.state, MetalState::DeployFailed, "{doc:#?}");
    assert!(doc.last_error.as_deref().is_some_and(|e| e.contains("did not apply power")), "{doc:#?}");
}

/// A BMC that never answers: the step's bounded attempts, then the failed state with the reason.
#[tokio::test]
async fn a_bmc_that_times_out_fails_the_workflow_after_bounded_attempts() {
    let w = world().await;
    let metal = w.reconciler();
    w.bmc().with(|s| s.misbehaviour = Misbehaviour::Hangs);
    w.verb(Verb::Manage, None, None, None).await;
    let doc = w.settle(&metal, 500).await;
    assert_eq!(doc.state, MetalState::Enroll, "{doc:#?}");
    let error = doc.last_error.clone().unwrap();
    assert!(error.contains(&format!("failed {STEP_ATTEMPTS_MAX} times")) && error.contains("did not answer"), "{error}");
    assert!(doc.flags.maintenance.is_none());
    assert_eq!(doc.workflow.as_ref().unwrap().outcome, WorkflowOutcome::Failed);
}

/// A deploy whose installed system never joins: deploy-wait's deadline, with the reason.
#[tokio::test]
async fn a_deploy_whose_agent_never_joins_fails_at_the_wait_deadline() {
    let w = world().await;
    let metal = w.reconciler();
    let deployed_at = w.deploy_until_it_waits_for_its_agent(&metal).await;
    w.clock.set_ms(deployed_at + WAIT_DEADLINE_S * 1000);
    metal.pass().await.unwrap();
    let doc = w.doc().await;
    assert_eq!(doc.state, MetalState::DeployFailed, "{doc:#?}");
    let error = doc.last_error.unwrap();
    assert!(error.contains("deploy-wait did not finish within its deadline of 1800 s (at step wait-agent)"), "{error}");
    assert!(w.deploy_token_revoked().await, "a failed deploy's join token outlives it");
}

/// An operator aborts a deploy waiting for its agent: deploy failed with the reason, the
/// workflow aborted, and the reconciler runs none of its steps after.
#[tokio::test]
async fn an_aborted_deploy_wait_ends_in_deploy_failed_and_runs_no_more_steps() {
    let w = world().await;
    let metal = w.reconciler();
    w.deploy_until_it_waits_for_its_agent(&metal).await;
    assert!(!w.deploy_token_revoked().await);
    let doc = w.verb(Verb::Abort, None, None, None).await;
    assert_eq!(doc.state, MetalState::DeployFailed, "{doc:#?}");
    // Its join token goes with it: the installed system cannot join (or re-key the node) later.
    assert!(w.deploy_token_revoked().await, "an aborted deploy's join token outlives it");
    assert_eq!(doc.workflow.as_ref().unwrap().outcome, WorkflowOutcome::Aborted);
    assert!(doc.last_error.as_deref().is_some_and(|e| e.contains("abort")), "{doc:#?}");
    let calls = w.bmc().with(|s| s.calls.len());
    let events = w.events().await.len();
    for _ in 0..5 {
        metal.pass().await.unwrap();
        w.clock.advance_ms(1_000);
    }
    // Only the power sync's reads of a machine at rest: no step of the deploy ran again.
    let after: Vec<String> = w.bmc().with(|s| s.calls[calls..].to_vec());
    assert!(after.iter().all(|c| c == "system"), "{after:?}");
    assert_eq!(w.events().await.len(), events, "nothing was recorded after the abort");
}

/// The BMC says on, the log says off: found within one sync interval, read again, recorded.
#[tokio::test]
async fn power_drift_is_found_read_again_and_recorded() {
    let w = world().await;
    let metal = w.reconciler();
    w.verb(Verb::Manage, None, None, None).await;
    let doc = w.settle(&metal, 10).await;
    assert_eq!(doc.power.as_deref(), Some("off"));
    w.bmc().with(|s| s.power = Some(PowerState::On));
    for pass in 0..DRIFT_READS as usize + 1 {
        metal.pass().await.unwrap();
        let power = w.doc().await.power;
        if pass + 1 < DRIFT_READS as usize {
            assert_eq!(power.as_deref(), Some("off"), "recorded after {DRIFT_READS} reads, not at read {}", pass + 1);
        }
        w.clock.advance_ms(1_000);
    }
    let doc = w.doc().await;
    assert_eq!(doc.power.as_deref(), Some("on"));
    let events = w.events().await;
    assert_eq!(events.iter().filter(|e| e.envelope.event_type == ev::METAL_POWER_DRIFTED).count(), 1);
}

/// A reconciler replaced by a new one (its process killed) before every step of a deploy, one
/// of them after the step ran on the BMC but before it was recorded: the deploy ends active and
/// the log shows each transition once.
#[tokio::test]
async fn a_reconciler_restarted_at_every_step_resumes_and_records_each_transition_once() {
    let w = world().await;
    w.verb(Verb::Manage, None, None, None).await;
    w.settle(&w.reconciler(), 10).await;
    w.verb(Verb::Provide, None, None, None).await;
    w.settle(&w.reconciler(), 20).await;
    let token = JoinTokenId::generate().to_string();
    w.verb(Verb::Deploy, Some(("img_x", "http://images.example/os.iso")), Some(&token), None).await;
    let mut joined = false;
    for round in 0..60 {
        let doc = w.doc().await;
        if doc.state == MetalState::Active {
            break;
        }
        if doc.state == MetalState::DeployWait && !joined {
            w.agent_joins(&token).await;
            joined = true;
        }
        if round == 3 {
            // Killed after the BMC did the step but before the append: run the step's effect by
            // hand, as the dead reconciler did, then let a new one run it again.
            w.bmc().with(|s| s.media_image = Some("http://images.example/os.iso".into()));
        }
        w.reconciler().pass().await.unwrap();
        w.clock.advance_ms(1_000);
    }
    let doc = w.doc().await;
    assert_eq!(doc.state, MetalState::Active, "{doc:#?}");
    assert_eq!(
        w.transitions().await[4..],
        ["deploy:available>deploying", "wait:deploying>deploy-wait", "done:deploy-wait>active"],
        "each transition once"
    );
    let events = w.events().await;
    let deploy = doc.workflow.unwrap();
    let done: Vec<u64> = events
        .iter()
        .filter(|e| e.envelope.event_type == ev::METAL_STEP_DONE)
        .map(|e| bc_core::canonical::to_json(&e.envelope.payload))
        .filter(|p| p["workflowId"] == deploy.workflow_id)
        .map(|p| p["index"].as_u64().unwrap())
        .collect();
    assert_eq!(done, (0..deploy.steps.len() as u64).collect::<Vec<_>>(), "each step recorded once, in order");
}
