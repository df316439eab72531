//! `bc-core`'s integration tests, one binary: each file is a module, named in nextest's output as
//! `integration FILE::test` (run one file with `cargo nextest run -p bc-core -E 'test(/^FILE::/)'`).

#[path = "support/seeded.rs"]
mod seeded;

mod answered;
mod batch_refusal;
mod chain_property;
mod conformance;
mod determinism;
mod failover;
mod fast_check_property;
mod merkle_vectors;
mod postgres_tls;
mod proof_index_overflow;
mod proof_property;
mod saved_checkpoint;
