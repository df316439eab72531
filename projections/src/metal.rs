//! The bare-metal provisioning lifecycle as data: the states a machine goes
//! through from "cabled" to "running tenants' work" and back, modelled on OpenStack Ironic's
//! (`ironic/common/states.py`), and the one table [`TRANSITIONS`] that says which verb moves
//! which state where. [`transition`] is the pure decision over it; every other (state, verb) is
//! refused naming the verbs allowed now, so a caller never guesses.
//!
//! What Ironic's users complain about shaped two rules here:
//! - **No wait without a deadline.** Every state a workflow passes through ([`MetalState::is_stable`]
//!   false) has one ([`MetalState::deadline_s`]); passing it is the internal verb `fail`, into the
//!   state's failed state with the reason. The graph tests prove every such state reaches a stable
//!   state.
//! - **No surprise deprovisioning.** Only a caller's `undeploy` leaves `active`; no internal verb
//!   does (a failed rescue stops in `rescue failed`, not in cleaning).
//!
//! `retired` is a flag, not a state: it blocks `provide` and `deploy`, and cleaning a retired node
//! ends in `manageable`. `maintenance` (with a reason) is a flag too: while it is set, only
//! `recover` (which clears it), `abort` and `power` are taken.

use serde::{Deserialize, Serialize};

/// Where a machine is in its lifecycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum MetalState {
    /// Known by its BMC address, not yet checked.
    Enroll,
    /// Its BMC credentials are being checked.
    Verifying,
    /// Under the operator's control, not offered.
    Manageable,
    Inspecting,
    InspectWait,
    InspectFailed,
    Cleaning,
    CleanWait,
    CleanFailed,
    /// Clean and offered for deploys.
    Available,
    Deploying,
    DeployWait,
    DeployFailed,
    /// Deployed: its installed system's agent joined as its node.
    Active,
    /// Being torn down; cleaning follows.
    Deleting,
    /// Tearing down failed: the operator decides (undeploy again, or deploy over it).
    Error,
    Rescuing,
    RescueWait,
    RescueFailed,
    /// Booted into a rescue system.
    Rescue,
    Unrescuing,
    UnrescueFailed,
}

/// What moves a machine: a caller's verb, or a workflow's own (`done`, `wait`, `fail`: the
/// `metal` reconciler's, never a caller's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Verb {
    Manage,
    Inspect,
    Provide,
    Deploy,
    Undeploy,
    Rescue,
    Unrescue,
    Retire,
    Recover,
    Abort,
    Power,
    /// The workflow's steps all succeeded.
    Done,
    /// The workflow waits on the machine (it booted something that must call back).
    Wait,
    /// A step failed, or the state's deadline passed.
    Fail,
}

impl Verb {
    /// The verbs a caller may use (the reference's `metal` commands that move a machine).
    pub const CALLER: &[Verb] = Verb::ALL.split_at(Verb::ALL.len() - 3).0;

    /// Every verb: the callers' first, then the workflow's three (`done`, `wait`, `fail`).
    pub const ALL: &[Verb] = &[
        Verb::Manage,
        Verb::Inspect,
        Verb::Provide,
        Verb::Deploy,
        Verb::Undeploy,
        Verb::Rescue,
        Verb::Unrescue,
        Verb::Retire,
        Verb::Recover,
        Verb::Abort,
        Verb::Power,
        Verb::Done,
        Verb::Wait,
        Verb::Fail,
    ];

    pub fn is_internal(self) -> bool {
        matches!(self, Verb::Done | Verb::Wait | Verb::Fail)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Verb::Manage => "manage",
            Verb::Inspect => "inspect",
            Verb::Provide => "provide",
            Verb::Deploy => "deploy",
            Verb::Undeploy => "undeploy",
            Verb::Rescue => "rescue",
            Verb::Unrescue => "unrescue",
            Verb::Retire => "retire",
            Verb::Recover => "recover",
            Verb::Abort => "abort",
            Verb::Power => "power",
            Verb::Done => "done",
            Verb::Wait => "wait",
            Verb::Fail => "fail",
        }
    }
}

/// The deadlines of the states a workflow passes through (Ironic's defaults: 30 minutes for
/// the deploy, inspect and clean waits); a power change within a step has its own.
pub const WAIT_DEADLINE_S: u64 = 30 * 60;
/// Checking a BMC's credentials: a few requests.
pub const VERIFY_DEADLINE_S: u64 = 5 * 60;
/// One power change, polled until the BMC applies it (BMCs apply power late).
pub const POWER_DEADLINE_S: u64 = 60;

use MetalState as S;
use Verb as V;

/// One row of the table: in `from`, `verb` moves to `to` (or `to_if_retired` on a retired
/// machine, where that differs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    pub from: MetalState,
    pub verb: Verb,
    pub to: MetalState,
    pub to_if_retired: Option<MetalState>,
}

const fn row(from: MetalState, verb: Verb, to: MetalState) -> Row {
    Row { from, verb, to, to_if_retired: None }
}

/// Every transition. `retire`, `recover` and `power` change no state (they set a flag or act on
/// the machine), so they are rows from a state to itself.
pub const TRANSITIONS: &[Row] = &[
    // Enrolment: the BMC is checked before the machine is managed.
    row(S::Enroll, V::Manage, S::Verifying),
    row(S::Verifying, V::Done, S::Manageable),
    row(S::Verifying, V::Fail, S::Enroll),
    // Inspection.
    row(S::Manageable, V::Inspect, S::Inspecting),
    row(S::Inspecting, V::Done, S::Manageable),
    row(S::Inspecting, V::Wait, S::InspectWait),
    row(S::Inspecting, V::Fail, S::InspectFailed),
    row(S::InspectWait, V::Done, S::Manageable),
    row(S::InspectWait, V::Fail, S::InspectFailed),
    row(S::InspectWait, V::Abort, S::InspectFailed),
    row(S::InspectFailed, V::Manage, S::Manageable),
    row(S::InspectFailed, V::Inspect, S::Inspecting),
    // Cleaning, then offered (a retired machine is cleaned back to manageable).
    row(S::Manageable, V::Provide, S::Cleaning),
    Row { from: S::Cleaning, verb: V::Done, to: S::Available, to_if_retired: Some(S::Manageable) },
    row(S::Cleaning, V::Wait, S::CleanWait),
    row(S::Cleaning, V::Fail, S::CleanFailed),
    Row { from: S::CleanWait, verb: V::Done, to: S::Available, to_if_retired: Some(S::Manageable) },
    row(S::CleanWait, V::Fail, S::CleanFailed),
    row(S::CleanWait, V::Abort, S::CleanFailed),
    row(S::CleanFailed, V::Manage, S::Manageable),
    row(S::Available, V::Manage, S::Manageable),
    // Deploying.
    row(S::Available, V::Deploy, S::Deploying),
    row(S::Deploying, V::Done, S::Active),
    row(S::Deploying, V::Wait, S::DeployWait),
    row(S::Deploying, V::Fail, S::DeployFailed),
    row(S::DeployWait, V::Done, S::Active),
    row(S::DeployWait, V::Fail, S::DeployFailed),
    row(S::DeployWait, V::Abort, S::DeployFailed),
    row(S::DeployFailed, V::Deploy, S::Deploying),
    row(S::DeployFailed, V::Undeploy, S::Deleting),
    // Tearing down: only a caller's undeploy leaves active.
    row(S::Active, V::Undeploy, S::Deleting),
    row(S::Active, V::Deploy, S::Deploying),
    row(S::Deleting, V::Done, S::Cleaning),
    row(S::Deleting, V::Fail, S::Error),
    row(S::Error, V::Undeploy, S::Deleting),
    row(S::Error, V::Deploy, S::Deploying),
    // Rescue.
    row(S::Active, V::Rescue, S::Rescuing),
    row(S::Rescuing, V::Done, S::Rescue),
    row(S::Rescuing, V::Wait, S::RescueWait),
    row(S::Rescuing, V::Fail, S::RescueFailed),
    row(S::RescueWait, V::Done, S::Rescue),
    row(S::RescueWait, V::Fail, S::RescueFailed),
    row(S::RescueWait, V::Abort, S::RescueFailed),
    row(S::Rescue, V::Unrescue, S::Unrescuing),
    row(S::Rescue, V::Undeploy, S::Deleting),
    row(S::Unrescuing, V::Done, S::Active),
    row(S::Unrescuing, V::Fail, S::UnrescueFailed),
    row(S::RescueFailed, V::Rescue, S::Rescuing),
    row(S::RescueFailed, V::Unrescue, S::Unrescuing),
    row(S::RescueFailed, V::Undeploy, S::Deleting),
    row(S::UnrescueFailed, V::Rescue, S::Rescuing),
    row(S::UnrescueFailed, V::Unrescue, S::Unrescuing),
    row(S::UnrescueFailed, V::Undeploy, S::Deleting),
    // Flags and power, in the stable states only (never while a workflow runs).
    row(S::Manageable, V::Retire, S::Manageable),
    row(S::Available, V::Retire, S::Available),
    row(S::Active, V::Retire, S::Active),
    row(S::InspectFailed, V::Retire, S::InspectFailed),
    row(S::CleanFailed, V::Retire, S::CleanFailed),
    row(S::DeployFailed, V::Retire, S::DeployFailed),
    row(S::Enroll, V::Recover, S::Enroll),
    row(S::Manageable, V::Recover, S::Manageable),
    row(S::Available, V::Recover, S::Available),
    row(S::Active, V::Recover, S::Active),
    row(S::Rescue, V::Recover, S::Rescue),
    row(S::InspectFailed, V::Recover, S::InspectFailed),
    row(S::CleanFailed, V::Recover, S::CleanFailed),
    row(S::DeployFailed, V::Recover, S::DeployFailed),
    row(S::RescueFailed, V::Recover, S::RescueFailed),
    row(S::UnrescueFailed, V::Recover, S::UnrescueFailed),
    row(S::Error, V::Recover, S::Error),
    row(S::Manageable, V::Power, S::Manageable),
    row(S::Available, V::Power, S::Available),
    row(S::Active, V::Power, S::Active),
    row(S::Rescue, V::Power, S::Rescue),
    row(S::InspectFailed, V::Power, S::InspectFailed),
    row(S::CleanFailed, V::Power, S::CleanFailed),
    row(S::DeployFailed, V::Power, S::DeployFailed),
    row(S::RescueFailed, V::Power, S::RescueFailed),
    row(S::UnrescueFailed, V::Power, S::UnrescueFailed),
    row(S::Error, V::Power, S::Error),
];

/// Every state, in the table's order of first appearance (for tests and listings).
pub const STATES: &[MetalState] = &[
    S::Enroll,
    S::Verifying,
    S::Manageable,
    S::Inspecting,
    S::InspectWait,
    S::InspectFailed,
    S::Cleaning,
    S::CleanWait,
    S::CleanFailed,
    S::Available,
    S::Deploying,
    S::DeployWait,
    S::DeployFailed,
    S::Active,
    S::Deleting,
    S::Error,
    S::Rescuing,
    S::RescueWait,
    S::RescueFailed,
    S::Rescue,
    S::Unrescuing,
    S::UnrescueFailed,
];

impl MetalState {
    pub fn as_str(self) -> &'static str {
        match self {
            S::Enroll => "enroll",
            S::Verifying => "verifying",
            S::Manageable => "manageable",
            S::Inspecting => "inspecting",
            S::InspectWait => "inspect-wait",
            S::InspectFailed => "inspect-failed",
            S::Cleaning => "cleaning",
            S::CleanWait => "clean-wait",
            S::CleanFailed => "clean-failed",
            S::Available => "available",
            S::Deploying => "deploying",
            S::DeployWait => "deploy-wait",
            S::DeployFailed => "deploy-failed",
            S::Active => "active",
            S::Deleting => "deleting",
            S::Error => "error",
            S::Rescuing => "rescuing",
            S::RescueWait => "rescue-wait",
            S::RescueFailed => "rescue-failed",
            S::Rescue => "rescue",
            S::Unrescuing => "unrescuing",
            S::UnrescueFailed => "unrescue-failed",
        }
    }

    /// Whether the machine rests here until a caller acts (no workflow runs).
    pub fn is_stable(self) -> bool {
        self.deadline_s().is_none()
    }

    /// How long a workflow may stay in this state before it fails (`None`: a stable state).
    pub fn deadline_s(self) -> Option<u64> {
        match self {
            S::Verifying => Some(VERIFY_DEADLINE_S),
            S::Inspecting
            | S::InspectWait
            | S::Cleaning
            | S::CleanWait
            | S::Deploying
            | S::DeployWait
            | S::Deleting
            | S::Rescuing
            | S::RescueWait
            | S::Unrescuing => Some(WAIT_DEADLINE_S),
            _ => None,
        }
    }
}

/// What a machine carries besides its state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MetalFlags {
    pub retired: bool,
    /// Why the machine is in maintenance (a BMC that answers 401, an operator's reason).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub maintenance: Option<String>,
}

/// Why a verb is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MetalRefusal {
    /// The verb has no row from this state: `allowed` are the caller's verbs that do.
    #[error("{verb} is not allowed in {state}; allowed now: {}", list(.allowed))]
    InvalidState { state: MetalState, verb: Verb, allowed: Vec<Verb> },
    #[error("{verb} is refused: the machine is retired (it is cleaned back to manageable, never offered or deployed)")]
    Retired { verb: Verb },
    #[error("{verb} is refused: the machine is in maintenance ({reason}); recover it first")]
    InMaintenance { verb: Verb, reason: String },
}

impl std::fmt::Display for MetalState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Display for Verb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

fn list(verbs: &[Verb]) -> String {
    if verbs.is_empty() {
        return "none (a workflow is running: wait for it, or abort it where a wait allows)".into();
    }
    verbs.iter().map(|v| v.as_str()).collect::<Vec<_>>().join(", ")
}

/// The caller's verbs `state` takes (what a refusal names), given the flags.
pub fn allowed(state: MetalState, flags: &MetalFlags) -> Vec<Verb> {
    let mut out: Vec<Verb> = TRANSITIONS
        .iter()
        .filter(|r| r.from == state && !r.verb.is_internal())
        .map(|r| r.verb)
        .filter(|v| !(flags.retired && matches!(v, V::Provide | V::Deploy)))
        .filter(|v| flags.maintenance.is_none() || matches!(v, V::Recover | V::Abort | V::Power))
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Where `verb` takes a machine in `state` with `flags`, or why not. Internal verbs (`done`,
/// `wait`, `fail`) are the workflow's and are taken in maintenance too: a running workflow ends.
pub fn transition(state: MetalState, flags: &MetalFlags, verb: Verb) -> Result<MetalState, MetalRefusal> {
    if !verb.is_internal() {
        if let Some(reason) = &flags.maintenance
            && !matches!(verb, V::Recover | V::Abort | V::Power)
        {
            return Err(MetalRefusal::InMaintenance { verb, reason: reason.clone() });
        }
        if flags.retired && matches!(verb, V::Provide | V::Deploy) {
            return Err(MetalRefusal::Retired { verb });
        }
    }
    let row = TRANSITIONS.iter().find(|r| r.from == state && r.verb == verb);
    match row {
        Some(r) => Ok(if flags.retired { r.to_if_retired.unwrap_or(r.to) } else { r.to }),
        None => Err(MetalRefusal::InvalidState { state, verb, allowed: allowed(state, flags) }),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeSet, VecDeque};

    use super::*;

    fn clean() -> MetalFlags {
        MetalFlags::default()
    }

    /// Every state is in [`STATES`] once, and every row names known states.
    #[test]
    fn the_table_names_every_state_and_no_row_twice() {
        let states: BTreeSet<MetalState> = STATES.iter().copied().collect();
        assert_eq!(states.len(), STATES.len());
        let mut seen = BTreeSet::new();
        for r in TRANSITIONS {
            assert!(states.contains(&r.from) && states.contains(&r.to), "{r:?}");
            assert!(seen.insert((r.from, r.verb)), "two rows for ({}, {})", r.from, r.verb);
        }
        for s in STATES {
            assert!(TRANSITIONS.iter().any(|r| r.from == *s || r.to == *s), "{s} is in no row");
        }
    }

    /// Every state a workflow passes through has a deadline, a `fail` row (what passing the
    /// deadline does) and a path to a stable state by the workflow's own verbs: nothing waits
    /// forever.
    #[test]
    fn every_unstable_state_has_a_deadline_and_reaches_a_stable_state() {
        // Written down here apart from `deadline_s` (which `is_stable` reads), so a state that
        // loses its deadline, or a new one added without one, fails: Ironic's stable states
        // (`STABLE_STATES` in ironic/common/states.py) and the failed states, where nothing runs.
        const RESTING: &[S] = &[
            S::Enroll,
            S::Manageable,
            S::Available,
            S::Active,
            S::Rescue,
            S::Error,
            S::InspectFailed,
            S::CleanFailed,
            S::DeployFailed,
            S::RescueFailed,
            S::UnrescueFailed,
        ];
        for s in STATES.iter().copied() {
            assert_eq!(s.is_stable(), RESTING.contains(&s), "{s}: stable is {}", s.is_stable());
        }
        for s in STATES.iter().copied().filter(|s| !RESTING.contains(s)) {
            assert!(s.deadline_s().is_some_and(|d| d > 0), "{s} has no deadline");
            let failed = transition(s, &clean(), V::Fail).unwrap_or_else(|e| panic!("{s} cannot fail: {e}"));
            // Breadth-first over the internal verbs only: no caller needed to get out.
            let mut queue = VecDeque::from([failed]);
            let mut seen = BTreeSet::from([s]);
            let mut reached = None;
            while let Some(next) = queue.pop_front() {
                if next.is_stable() {
                    reached = Some(next);
                    break;
                }
                if seen.insert(next) {
                    for verb in [V::Done, V::Fail] {
                        if let Ok(to) = transition(next, &clean(), verb) {
                            queue.push_back(to);
                        }
                    }
                }
            }
            assert!(reached.is_some(), "{s}: failing never reaches a stable state");
            assert!(transition(s, &clean(), V::Done).is_ok(), "{s} cannot finish");
        }
    }

    /// Every stable state is reachable from `enroll`, and `active` is reachable and left only by
    /// a caller's `undeploy` (or a redeploy): no internal verb takes a machine out of `active`.
    #[test]
    fn active_is_reached_from_enroll_and_left_only_by_a_caller() {
        let mut reached = BTreeSet::from([S::Enroll]);
        let mut queue = VecDeque::from([S::Enroll]);
        while let Some(s) = queue.pop_front() {
            for r in TRANSITIONS.iter().filter(|r| r.from == s) {
                if reached.insert(r.to) {
                    queue.push_back(r.to);
                }
            }
        }
        assert_eq!(
            reached.len(),
            STATES.len(),
            "unreachable: {:?}",
            STATES.iter().filter(|s| !reached.contains(s)).collect::<Vec<_>>()
        );
        for verb in [V::Done, V::Wait, V::Fail] {
            assert!(transition(S::Active, &clean(), verb).is_err(), "active left by {verb}");
        }
        let leaving: BTreeSet<Verb> =
            TRANSITIONS.iter().filter(|r| r.from == S::Active && r.to != S::Active).map(|r| r.verb).collect();
        assert_eq!(leaving, BTreeSet::from([V::Deploy, V::Undeploy, V::Rescue]));
    }

    /// The reference's `metal` verbs that move a machine each have a row (enroll creates the
    /// machine in `enroll`, so it is not a transition).
    #[test]
    fn every_verb_of_the_reference_has_its_row() {
        // The lifecycle verbs of `better-compute metal` in the reference's command table
        // (shared/reference/cli-client.md), copied as text so the code's own list cannot vouch
        // for itself. `enroll` makes the machine (in `enroll`), so it has no row; `discovered`,
        // `confirm-mac` and `bulk` are not lifecycle verbs.
        const REFERENCE: &[&str] =
            &["manage", "inspect", "provide", "rescue", "unrescue", "recover", "retire", "deploy", "undeploy", "abort", "power"];
        for name in REFERENCE {
            let verb = Verb::ALL.iter().find(|v| v.as_str() == *name).unwrap_or_else(|| panic!("no verb {name}"));
            assert!(!verb.is_internal(), "{name} is a caller's verb");
            assert!(TRANSITIONS.iter().any(|r| r.verb == *verb), "{name} has no row");
        }
        let callers: BTreeSet<&str> = Verb::CALLER.iter().map(|v| v.as_str()).collect();
        assert_eq!(callers, REFERENCE.iter().copied().collect(), "the caller's verbs are the reference's");
    }

    #[test]
    fn a_machine_goes_from_enroll_to_active_and_back_to_available() {
        let f = clean();
        let mut s = S::Enroll;
        for (verb, expected) in [
            (V::Manage, S::Verifying),
            (V::Done, S::Manageable),
            (V::Provide, S::Cleaning),
            (V::Done, S::Available),
            (V::Deploy, S::Deploying),
            (V::Wait, S::DeployWait),
            (V::Done, S::Active),
            (V::Undeploy, S::Deleting),
            (V::Done, S::Cleaning),
            (V::Done, S::Available),
        ] {
            s = transition(s, &f, verb).unwrap();
            assert_eq!(s, expected, "after {verb}");
        }
    }

    #[test]
    fn retired_blocks_provide_and_deploy_and_cleaning_ends_in_manageable() {
        let retired = MetalFlags { retired: true, maintenance: None };
        assert_eq!(transition(S::Manageable, &retired, V::Provide), Err(MetalRefusal::Retired { verb: V::Provide }));
        assert_eq!(transition(S::Available, &retired, V::Deploy), Err(MetalRefusal::Retired { verb: V::Deploy }));
        assert_eq!(transition(S::Cleaning, &retired, V::Done), Ok(S::Manageable));
        assert_eq!(transition(S::CleanWait, &retired, V::Done), Ok(S::Manageable));
        assert!(!allowed(S::Available, &retired).contains(&V::Deploy));
        // An active retired machine is torn down and cleaned back to manageable.
        let deleting = transition(S::Active, &retired, V::Undeploy).unwrap();
        let cleaning = transition(deleting, &retired, V::Done).unwrap();
        assert_eq!(transition(cleaning, &retired, V::Done), Ok(S::Manageable));
    }

    #[test]
    fn another_verb_is_refused_naming_the_verbs_allowed_now() {
        let e = transition(S::Available, &clean(), V::Rescue).unwrap_err();
        let MetalRefusal::InvalidState { allowed, .. } = &e else { panic!("{e:?}") };
        assert_eq!(allowed, &[V::Manage, V::Deploy, V::Retire, V::Recover, V::Power]);
        assert_eq!(e.to_string(), "rescue is not allowed in available; allowed now: manage, deploy, retire, recover, power");
        let waiting = transition(S::Deploying, &clean(), V::Undeploy).unwrap_err();
        assert!(waiting.to_string().contains("a workflow is running"), "{waiting}");
        assert_eq!(transition(S::DeployWait, &clean(), V::Abort), Ok(S::DeployFailed), "a wait can be aborted");
    }

    #[test]
    fn maintenance_takes_only_recover_abort_and_power_but_a_running_workflow_still_ends() {
        let m = MetalFlags { retired: false, maintenance: Some("bmc-unauthorized: 401 from the BMC".into()) };
        let e = transition(S::Available, &m, V::Deploy).unwrap_err();
        assert!(matches!(e, MetalRefusal::InMaintenance { .. }), "{e:?}");
        assert!(e.to_string().contains("401"));
        assert_eq!(transition(S::Available, &m, V::Recover), Ok(S::Available));
        assert_eq!(transition(S::DeployWait, &m, V::Abort), Ok(S::DeployFailed));
        assert_eq!(transition(S::Deploying, &m, V::Fail), Ok(S::DeployFailed), "the workflow's own verbs still run");
        assert_eq!(allowed(S::Available, &m), [V::Recover, V::Power]);
    }
}
