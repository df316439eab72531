//! The OpenAPI document tested from the outside by schemathesis, a property-based API tester we
//! did not write: `scripts/schemathesis` starts this build's `better-compute dev` on a fresh data
//! directory and a free loopback port and runs every check of `schemathesis.toml` (status codes,
//! content types, response schemas, negative data rejected) over every operation, with a fixed
//! seed. It runs here, inside the one test run, so its minutes overlap the other tests instead
//! of coming before them, with [`SUITE_MAX_EXAMPLES`] examples an operation and phase (its
//! deterministic coverage phase whole); `make schemathesis` runs the same script alone with the
//! script's default, twice as many; `SCHEMATHESIS_SEED` and `SCHEMATHESIS_MAX_EXAMPLES` change
//! the seed and the examples (here too). The
//! exit status alone proves little (a run that tested nothing exits 0 too): the summary must
//! show every method of the table selected, and cases generated and passed for them.

use std::path::Path;
use std::process::Command;

#[test]
fn every_operation_keeps_the_openapi_document_under_schemathesis() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let tool = root.join("target/schemathesis/venv/bin/schemathesis");
    // Missing, the test fails: it never skips.
    assert!(
        tool.exists(),
        "no schemathesis at {} (run `make schemathesis-venv`, which `make test` runs; it installs schemathesis from PyPI)",
        tool.display()
    );
    let server = bc_tests::binary("better-compute");
    let examples = std::env::var("SCHEMATHESIS_MAX_EXAMPLES").unwrap_or_else(|_| SUITE_MAX_EXAMPLES.to_string());
    let run = Command::new(root.join("scripts/schemathesis"))
        .env("BETTER_COMPUTE_BIN", &server)
        .env("SCHEMATHESIS_MAX_EXAMPLES", examples)
        .current_dir(&root)
        .output()
        .expect("scripts/schemathesis");
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    // The script's summary (exit status, cases, seed, the command, where the reports are) is
    // its last lines; the whole output is in target/schemathesis/output.txt.
    assert!(
        run.status.success(),
        "schemathesis failed ({}); reproduce with `make schemathesis` (the seed and command below)\n{stdout}\n{stderr}",
        run.status
    );
    assert!(stdout.contains("schemathesis exit status: 0"), "no summary from the script:\n{stdout}\n{stderr}");
    // It ran what it claims: every method of the table an operation, and cases for each.
    let methods = bc_gateway::api::table().len();
    let line = |prefix: &str| stdout.lines().find_map(|l| l.strip_prefix(prefix)).map(str::to_owned);
    let operations = line("operations: ").unwrap_or_default();
    assert_eq!(operations, format!("{methods} selected / {methods} total"), "every method is tested:\n{stdout}");
    let cases = line("test cases: ").unwrap_or_default();
    let count = |word: &str| -> Option<usize> { cases.split(", ").find_map(|part| part.strip_suffix(word)?.trim().parse().ok()) };
    let generated = count(" generated").unwrap_or_else(|| panic!("no count of generated cases: {cases:?}"));
    assert!(generated >= methods * CASES_PER_OPERATION_MIN, "{generated} cases for {methods} operations:\n{stdout}");
    assert_eq!(count(" passed"), Some(generated), "every generated case passed its checks: {cases:?}");
    assert_eq!(count(" errored"), None, "no case errored: {cases:?}");
}

/// Examples an operation gets in each generating phase inside `make test`: under a third of the
/// script's default. With 50 it ran 19,663 cases in 507 s of a 661 s suite on 2 cores (the suite
/// is bound by its CPU), and the clean-clone `make test` took 26 min, past the bar of well under
/// 20; with 25, as the API grew (sites, projects, snapshots), 450 s of a 659 s suite and 26.5 min
/// again (2026-12-07). The coverage phase (each schema's edges, deterministic) does not depend on
/// it; `make schemathesis` runs the default.
const SUITE_MAX_EXAMPLES: u32 = 15;

/// Cases each operation gets at the least, on average (`SCHEMATHESIS_MAX_EXAMPLES` may be as low as 1).
const CASES_PER_OPERATION_MIN: usize = 1;
