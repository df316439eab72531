//! `bc-gateway`'s integration tests, one binary: each file is a module, named in nextest's output
//! as `integration FILE::test` (run one file with `cargo nextest run -p bc-gateway -E 'test(/^FILE::/)'`).

mod common;
mod h2_flood;

mod agents_hardening;
mod determinism;
mod hardening;
mod join_limits;
mod join_requests;
mod key_cache;
mod sealed_join;
mod tpm_join;
mod tunnels;
mod watch_seam;
