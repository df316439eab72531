//! Issue 15, finding 7: `NoTls` was hard-coded, so `sslmode=require` failed and the default sent
//! webhook secrets and events in clear text. Against the local PostgreSQL, given a certificate
//! this test makes (its own CA, a server certificate for 127.0.0.1 and localhost): `require`
//! and the default (`prefer`) encrypt, `verify-full` with the test's CA connects, with another
//! CA it is refused, and `disable` is plain.
//!
//! The test points the cluster's `ssl_cert_file`/`ssl_key_file` at its files (written where the
//! postgres user reads them, next to the data directory) and reloads; plain connections and
//! other tests' `prefer` connections are unaffected. At the end it resets both settings.

// A test, outside the simulator: fresh random ids, the real clock and timings (clippy.toml).
#![allow(clippy::disallowed_methods)]

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bc_core::store::postgres::PostgresStore;
use bc_core::testing::{ScratchDatabase, admin_url};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use tokio_postgres::NoTls;

/// A CA: its certificate (PEM) and an issuer to sign with.
fn ca(name: &str) -> (String, Issuer<'static, KeyPair>) {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    let key = KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    (cert.pem(), Issuer::new(params, key))
}

/// Whether the session of a connection from `store` is encrypted (`pg_stat_ssl`).
async fn encrypted(store: &PostgresStore) -> bool {
    let client = store.pool().get().await.unwrap();
    client.query_one("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()", &[]).await.unwrap().get(0)
}

fn with_query(url: &str, query: &str) -> String {
    format!("{url}?{query}")
}

#[tokio::test]
async fn finding_7_sslmode_is_honoured_with_rustls() {
    let db = ScratchDatabase::create().await.expect("PostgreSQL is required for this suite");
    let (admin, connection) = tokio_postgres::connect(&admin_url(), NoTls).await.unwrap();
    tokio::spawn(connection);

    let (ca_pem, issuer) = ca("bc test CA");
    let server_key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
    params.distinguished_name.push(DnType::CommonName, "localhost");
    let server_cert = params.signed_by(&server_key, &issuer).unwrap();

    // Next to the data directory, owned by its owner (the postgres user), the key 0600.
    let data_dir: String = admin.query_one("SHOW data_directory", &[]).await.unwrap().get(0);
    let owner = std::fs::metadata(&data_dir).expect("the data directory is on this machine");
    let dir: PathBuf = Path::new(&data_dir).parent().unwrap().join("bc-test-tls");
    std::fs::create_dir_all(&dir).unwrap();
    let (cert_file, key_file) = (dir.join("server.crt"), dir.join("server.key"));
    std::fs::write(&cert_file, server_cert.pem()).unwrap();
    std::fs::write(&key_file, server_key.serialize_pem()).unwrap();
    std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    for path in [&dir, &cert_file, &key_file] {
        std::os::unix::fs::chown(path, Some(owner.uid()), Some(owner.gid())).unwrap();
    }
    let client_dir = tempfile::tempdir().unwrap();
    let ca_file = client_dir.path().join("ca.pem");
    std::fs::write(&ca_file, &ca_pem).unwrap();
    let other_ca_file = client_dir.path().join("other-ca.pem");
    std::fs::write(&other_ca_file, ca("another CA").0).unwrap();

    // One statement at a time: ALTER SYSTEM does not run in a (batch's implicit) transaction.
    for statement in [
        "ALTER SYSTEM SET ssl = on".to_owned(),
        format!("ALTER SYSTEM SET ssl_cert_file = '{}'", cert_file.display()),
        format!("ALTER SYSTEM SET ssl_key_file = '{}'", key_file.display()),
    ] {
        admin.batch_execute(&statement).await.unwrap();
    }
    admin.batch_execute("SELECT pg_reload_conf()").await.unwrap();
    let verify_full = with_query(&db.url, &format!("sslmode=verify-full&sslrootcert={}", ca_file.display()));
    // The reload takes effect for new connections shortly after.
    let deadline = Instant::now() + Duration::from_secs(15);
    let verified = loop {
        match PostgresStore::connect(&verify_full).await {
            Ok(store) => break store,
            Err(e) => {
                assert!(Instant::now() < deadline, "verify-full with the test's CA never connected: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let checks = async {
        assert!(encrypted(&verified).await, "verify-full is encrypted");
        let required = PostgresStore::connect(&with_query(&db.url, "sslmode=require")).await.expect("sslmode=require");
        assert!(encrypted(&required).await, "require is encrypted");
        let default = PostgresStore::connect(&db.url).await.expect("the default");
        assert!(encrypted(&default).await, "the default (prefer) is encrypted when the server offers TLS");
        let plain = PostgresStore::connect(&with_query(&db.url, "sslmode=disable")).await.expect("sslmode=disable");
        assert!(!encrypted(&plain).await, "disable is plain");
        let wrong = with_query(&db.url, &format!("sslmode=verify-full&sslrootcert={}", other_ca_file.display()));
        let refused = PostgresStore::connect(&wrong).await.err().expect("verify-full with another CA is refused");
        assert!(refused.to_string().contains("cannot connect"), "{refused}");
        let system_roots = PostgresStore::connect(&with_query(&db.url, "sslmode=verify-full")).await;
        assert!(system_roots.is_err(), "the test's CA is not among the system's roots");
    };
    // Whatever the checks found, the cluster gets its own certificate back.
    let outcome = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(checks)).await;
    for setting in ["ssl_cert_file", "ssl_key_file", "ssl"] {
        admin.batch_execute(&format!("ALTER SYSTEM RESET {setting}")).await.unwrap();
    }
    admin.batch_execute("SELECT pg_reload_conf()").await.unwrap();
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}
