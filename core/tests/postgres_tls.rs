//! `sslmode` is honoured with rustls (it was once `NoTls`, hard-coded, so `require` failed and the
//! default sent webhook secrets and events in clear text). Against a PostgreSQL cluster of the
//! test's own, serving a certificate the test makes (its own CA, a server certificate for
//! 127.0.0.1 and localhost): `require` and the default (`prefer`) encrypt, `verify-full` with the
//! test's CA connects, with another CA it is refused, and `disable` is plain.
//!
//! The cluster is made with `initdb` in a temporary directory and started with `pg_ctl` on a free
//! loopback port (as the `postgres` user when the test runs as root: PostgreSQL refuses root),
//! TLS on from its first start, and stopped when the test ends however it ends. The shared
//! cluster the other PostgreSQL tests use is never touched. Without PostgreSQL's server binaries
//! (Debian's `postgresql`), the test fails and says so; it never skips.

// A test, outside the simulator: fresh random ids, the real clock and timings (clippy.toml).
#![allow(clippy::disallowed_methods)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use bc_core::store::postgres::PostgresStore;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

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

/// The directory of PostgreSQL's server binaries (`initdb`, `pg_ctl`): `BC_TEST_PG_BINDIR`, else
/// the newest of Debian's `/usr/lib/postgresql/*/bin`.
fn server_bindir() -> PathBuf {
    if let Some(dir) = std::env::var_os("BC_TEST_PG_BINDIR") {
        return PathBuf::from(dir);
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|dirs| dirs.filter_map(|d| d.ok()).map(|d| d.path().join("bin")).filter(|b| b.join("initdb").exists()).collect())
        .unwrap_or_default();
    found.sort_by_key(|p| p.parent().and_then(|v| v.file_name()).and_then(|v| v.to_str()?.parse::<u32>().ok()));
    found.pop().unwrap_or_else(|| {
        panic!(
            "no PostgreSQL server binaries (initdb, pg_ctl) under /usr/lib/postgresql/*/bin: install Debian's postgresql \
             (apt-get install postgresql), or name their directory in BC_TEST_PG_BINDIR"
        )
    })
}

/// A PostgreSQL cluster of this test's own: stopped (immediately) when dropped.
struct Cluster {
    bindir: PathBuf,
    data: PathBuf,
    /// As whom the server runs: `postgres` when this process is root, else this process's user.
    as_postgres: bool,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Cluster {
    /// `bin` run as the cluster's user.
    fn command(&self, bin: &str) -> Command {
        command_as(self.as_postgres, &self.bindir.join(bin))
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.command("pg_ctl").args(["stop", "-m", "immediate", "-w", "-D"]).arg(&self.data).output();
    }
}

fn command_as(as_postgres: bool, program: &Path) -> Command {
    if as_postgres {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(program);
        command
    } else {
        Command::new(program)
    }
}

fn run(mut command: Command, what: &str) {
    let out = command.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Gives `path` to the `postgres` user, who runs the cluster when this test runs as root.
fn chown_to_postgres(path: &Path) {
    let mut chown = Command::new("chown");
    chown.arg("postgres:postgres").arg(path);
    run(chown, &format!("chown {} to postgres", path.display()));
}

/// A new cluster serving `cert_pem`/`key_pem` with TLS on, on a free loopback port.
fn start_cluster(cert_pem: &str, key_pem: &str) -> Cluster {
    let bindir = server_bindir();
    let uid = Command::new("id").arg("-u").output().expect("id -u");
    let as_postgres = String::from_utf8_lossy(&uid.stdout).trim() == "0";
    let dir = tempfile::Builder::new().prefix("bc-pg-tls-").tempdir().unwrap();
    let data = dir.path().join("data");
    if as_postgres {
        chown_to_postgres(dir.path());
    }
    let mut initdb = command_as(as_postgres, &bindir.join("initdb"));
    initdb.args(["-U", "postgres", "--auth=trust", "--no-sync", "-D"]).arg(&data);
    run(initdb, "initdb");
    // The server's certificate and key inside its data directory, its own (the key 0600).
    for (name, pem, mode) in [("server.crt", cert_pem, 0o644), ("server.key", key_pem, 0o600)] {
        let path = data.join(name);
        std::fs::write(&path, pem).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        if as_postgres {
            chown_to_postgres(&path);
        }
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let options = format!(
        "-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={} -c ssl=on -c fsync=off",
        dir.path().display()
    );
    let cluster = Cluster { bindir, data: data.clone(), as_postgres, port, _dir: dir };
    let mut start = cluster.command("pg_ctl");
    start.args(["start", "-w", "-t", "60", "-l"]).arg(data.join("server.log")).arg("-D").arg(&data).args(["-o", &options]);
    run(start, "pg_ctl start");
    cluster
}

#[tokio::test]
async fn sslmode_is_honoured_with_rustls() {
    let (ca_pem, issuer) = ca("bc test CA");
    let server_key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
    params.distinguished_name.push(DnType::CommonName, "localhost");
    let server_cert = params.signed_by(&server_key, &issuer).unwrap();
    let cluster = start_cluster(&server_cert.pem(), &server_key.serialize_pem());
    let url = cluster.url();

    let client_dir = tempfile::tempdir().unwrap();
    let ca_file = client_dir.path().join("ca.pem");
    std::fs::write(&ca_file, &ca_pem).unwrap();
    let other_ca_file = client_dir.path().join("other-ca.pem");
    std::fs::write(&other_ca_file, ca("another CA").0).unwrap();

    let verify_full = with_query(&url, &format!("sslmode=verify-full&sslrootcert={}", ca_file.display()));
    let verified = PostgresStore::connect(&verify_full).await.expect("verify-full with the test's CA");
    assert!(encrypted(&verified).await, "verify-full is encrypted");
    let required = PostgresStore::connect(&with_query(&url, "sslmode=require")).await.expect("sslmode=require");
    assert!(encrypted(&required).await, "require is encrypted");
    let default = PostgresStore::connect(&url).await.expect("the default");
    assert!(encrypted(&default).await, "the default (prefer) is encrypted when the server offers TLS");
    let plain = PostgresStore::connect(&with_query(&url, "sslmode=disable")).await.expect("sslmode=disable");
    assert!(!encrypted(&plain).await, "disable is plain");
    let wrong = with_query(&url, &format!("sslmode=verify-full&sslrootcert={}", other_ca_file.display()));
    let refused = PostgresStore::connect(&wrong).await.err().expect("verify-full with another CA is refused");
    assert!(refused.to_string().contains("cannot connect"), "{refused}");
    let system_roots = PostgresStore::connect(&with_query(&url, "sslmode=verify-full")).await;
    assert!(system_roots.is_err(), "the test's CA is not among the system's roots");
}
