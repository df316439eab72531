//! Every end-to-end test of the workspace, in one test binary: each file beside this one is a
//! module (its tests named `FILE::test`, e.g. `sim_run::many_seeds…`; `cargo nextest run -E
//! 'test(/^audit_/)'` picks some). One binary instead of one per file: each had to be compiled
//! and linked on its own, about a minute and a half of a clean build on 2 cores.

mod agent;
mod agent_doctor;
mod agent_sim;
mod agents_endpoint;
mod api;
mod audit_e2e;
mod audit_follow;
mod audit_follow_rotation;
mod audit_tamper;
mod audit_tiles;
mod audit_witness;
mod auth;
mod bad_input;
mod bcd_update;
mod cli_items;
mod client_policy;
mod config;
mod crash;
mod doctor;
mod flavors_images;
mod forward;
mod hardening;
mod health;
mod holds_property;
mod instances;
mod inventory;
mod join_tokens_cli;
mod metal;
mod method_table;
mod metrics;
mod postgres;
mod rate_limits;
mod rebuild;
mod reconcilers;
mod redfish;
mod replay;
mod reservations;
mod review_regressions;
mod roles;
mod rollouts;
mod schemathesis;
mod secrets_at_rest;
mod sim_report;
mod sim_run;
mod ssh_cert;
mod support_bundle;
mod tunnels;
mod usage;
mod watch;
mod watch_limits;
mod watch_tail;
mod webhook_egress;
mod webhooks;
