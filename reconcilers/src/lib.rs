//! `bc-reconcilers`: the background work, each reconciler runnable in its own process
//! (`better-compute reconcile --only NAME`) or inside `dev` and `serve`.
//!
//! Layout:
//! - [`driver`]: the one shape: the [`driver::Reconciler`] trait (a name, one pass, a report) and
//!   [`driver::run`], which activates one on its schedule and records each activation;
//! - [`registry`]: every reconciler, in one list, and how each is built and started;
//! - [`outbox`]: the framework: the [`outbox::Consumer`] trait, the fan-out and work loops, leases,
//!   the retry schedule and dead letters;
//! - [`webhooks`]: signed webhook deliveries (Standard Webhooks);
//! - [`reservations`]: queued → active → expired, on the decisions of `bc_projections::decide`;
//! - [`instances`]: each instance made what it should be (applied again on drift, deleted when
//!   its reservation ends);
//! - [`metal`]: each bare-metal machine's workflow run against its BMC, step by step, with
//!   deadlines; and its power state kept true to the machine;
//! - [`checkpoints`]: seals signed checkpoints of the tenants whose logs grew;
//! - [`liveness`]: node leases into `node.ready` / `node.unreachable`, and commands failed at
//!   their deadline;
//! - [`witnesses`]: sends checkpoints to witnesses and appends their cosignatures;
//! - [`status`]: each reconciler's last pass, recorded for `better-compute reconcilers status`.
//!
//! Dependencies: `bc-core` (storage, signing, the URL policy) and `bc-projections` (the
//! documents consumers read). Never the gateway: consumers talk to the database, not to HTTP
//! handlers.

pub mod checkpoints;
pub mod driver;
pub mod instances;
pub mod liveness;
pub mod metal;
pub mod outbox;
pub mod registry;
pub mod reservations;
pub mod rollouts;
pub mod status;
pub mod webhooks;
pub mod witnesses;

/// Waits `ms`, or until this process commits (`wake`, dropped once the appender is gone), or
/// until shutdown: how the loops here idle.
pub(crate) async fn idle(
    ms: u64,
    wake: &mut Option<tokio::sync::watch::Receiver<u64>>,
    shutdown: &mut tokio::sync::watch::Receiver<bool>,
) {
    let sleep = tokio::time::sleep(std::time::Duration::from_millis(ms));
    match wake.as_mut() {
        Some(w) => tokio::select! {
            _ = sleep => {}
            changed = w.changed() => if changed.is_err() { *wake = None },
            _ = shutdown.changed() => {}
        },
        None => tokio::select! {
            _ = sleep => {}
            _ = shutdown.changed() => {}
        },
    }
}
