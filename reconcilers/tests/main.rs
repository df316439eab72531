//! `bc-reconcilers`'s integration tests, one binary: each file is a module, named in nextest's
//! output as `integration FILE::test` (run one file with `cargo nextest run -p bc-reconcilers -E 'test(/^FILE::/)'`).

mod support;

mod fan_out;
mod metal;
mod metal_fairness;
mod outbox_runner;
