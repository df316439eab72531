//! The seeded runner the property tests of this crate share: its randomness comes from the
//! test's seed alone (`bc_core::testing::seed`), so `BC_TEST_SEED` replays a failure.

use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

/// A runner of `cases` cases drawn from `seed`, persisting no failures to disk.
pub fn runner(seed: u64, cases: u32) -> TestRunner {
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    TestRunner::new_with_rng(
        Config { cases, failure_persistence: None, ..Config::default() },
        TestRng::from_seed(RngAlgorithm::ChaCha, &bytes),
    )
}
