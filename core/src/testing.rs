//! Test support shared by this workspace's suites: scratch PostgreSQL databases and seeds.
//! Used only by tests and benchmarks; nothing in the product calls it.

// Test support, outside every simulated path (clippy.toml): a scratch database's random name.
#![allow(clippy::disallowed_methods)]

use crate::error::{Error, Result};

/// The server tests use; override with `BC_TEST_DATABASE_URL` (a URL to its `postgres` database).
pub const DEFAULT_ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

pub fn admin_url() -> String {
    std::env::var("BC_TEST_DATABASE_URL").unwrap_or_else(|_| DEFAULT_ADMIN_URL.to_owned())
}

/// A database created for one test and dropped (with `FORCE`) when this value is dropped.
pub struct ScratchDatabase {
    pub name: String,
    pub url: String,
    admin_url: String,
}

impl ScratchDatabase {
    /// Creates `bc_test_<random>`. Fails loudly, with how to get a server, when none answers:
    /// the PostgreSQL suite never skips silently.
    pub async fn create() -> Result<Self> {
        let admin_url = admin_url();
        let (client, connection) = tokio_postgres::connect(&admin_url, tokio_postgres::NoTls).await.map_err(|e| {
            Error::Unavailable(format!(
                "no PostgreSQL at {admin_url}: {e}\nhint: start one with `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start`, or set BC_TEST_DATABASE_URL"
            ))
        })?;
        tokio::spawn(connection);
        let name = format!("bc_test_{:016x}", rand::random::<u64>());
        client.batch_execute(&format!("CREATE DATABASE {name}")).await?;
        let base = admin_url.rsplit_once('/').map(|(base, _)| base).unwrap_or(&admin_url);
        Ok(Self { url: format!("{base}/{name}"), name, admin_url })
    }
}

impl Drop for ScratchDatabase {
    fn drop(&mut self) {
        let (admin_url, name) = (self.admin_url.clone(), self.name.clone());
        // Drop runs outside async context; use a thread with its own runtime.
        let _ = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
            runtime.block_on(async move {
                if let Ok((client, connection)) = tokio_postgres::connect(&admin_url, tokio_postgres::NoTls).await {
                    tokio::spawn(connection);
                    let _ = client.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await;
                }
            });
        })
        .join();
    }
}

/// The seed a randomized test runs from when `BC_TEST_SEED` gives none: fixed, so every run of
/// the suite draws the same cases and a failure in CI is the failure on a laptop.
pub const DEFAULT_SEED: u64 = 0x5eed_0000_0053;

/// The seed of a randomized test: `BC_TEST_SEED` if set (to replay a failure, or to explore other
/// cases), else [`DEFAULT_SEED`]. A test prints it on failure, as `BC_TEST_SEED=…`.
pub fn seed() -> u64 {
    match std::env::var("BC_TEST_SEED") {
        Ok(text) if !text.is_empty() => text.parse().expect("BC_TEST_SEED must be an unsigned integer"),
        _ => DEFAULT_SEED,
    }
}
