//! OpenStack's sushy-tools Redfish emulator (`sushy-emulator --fake`, from the virtual
//! environment `make sushy-venv` makes) as the tests run it: over HTTPS with a certificate from
//! a CA the test makes, behind HTTP basic auth (an htpasswd file, bcrypt), with three fake systems
//! whose every change of state (`external_notifier`) is PUT to a recorder here, so a test sees
//! what the emulator did, not only what a client reads back. Missing the emulator, a test fails
//! with what to run; it never skips.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bc_bmc::redfish::RedfishBmc;
use bc_bmc::{Bmc, BmcTarget, BmcTls, PowerState};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use serde_json::Value;

use crate::free_port;

pub const USERNAME: &str = "admin";
pub const PASSWORD: &str = "correct horse battery staple";

/// The emulator's fake systems (uuids are what sushy names them by).
pub const SYSTEM_A: &str = "5d7a1a36-1f0b-4d9e-9a43-000000000a01";
pub const SYSTEM_B: &str = "5d7a1a36-1f0b-4d9e-9a43-000000000b02";
/// A third, for the batch test's three machines.
pub const SYSTEM_C: &str = "5d7a1a36-1f0b-4d9e-9a43-000000000c03";

/// How long the emulator may take to listen.
pub const EMULATOR_START_S: u64 = 30;

/// How long a power change may take to show: sushy's fake applies it 1 to 11 s after the reset.
pub const POWER_APPLIES_S: u64 = 30;

/// The sushy-tools virtual environment `make sushy-venv` makes (`BC_SUSHY_VENV` names another).
pub fn sushy_venv() -> PathBuf {
    let venv = std::env::var_os("BC_SUSHY_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/sushy-venv"));
    assert!(
        venv.join("bin/sushy-emulator").exists(),
        "no sushy-emulator at {} (run `make sushy-venv`, which `make test` runs; it installs sushy-tools from PyPI)",
        venv.join("bin/sushy-emulator").display()
    );
    venv
}

/// A CA: its certificate (PEM) and an issuer to sign with.
pub fn ca(name: &str) -> (String, Issuer<'static, KeyPair>) {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    let key = KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    (cert.pem(), Issuer::new(params, key))
}

/// The test's certificates: the CA that signed the emulator's certificate, another CA, the
/// emulator's certificate and key, and the pin of its key.
pub struct Pki {
    pub ca_pem: String,
    pub other_ca_pem: String,
    pub server_pem: String,
    pub server_key_pem: String,
    pub pin: String,
}

pub fn pki() -> Pki {
    let (ca_pem, issuer) = ca("bc redfish test CA");
    let (other_ca_pem, _) = ca("another CA");
    let key = KeyPair::generate().unwrap();
    // Named `localhost` only, so an address by IP is the wrong name.
    let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
    params.distinguished_name.push(DnType::CommonName, "sushy-emulator");
    let server = params.signed_by(&key, &issuer).unwrap();
    let pin = bc_bmc::redfish::spki_pin(server.der()).unwrap();
    Pki { ca_pem, other_ca_pem, server_pem: server.pem(), server_key_pem: key.serialize_pem(), pin }
}

/// Every state sushy's fake driver saved of a system, in order (its `external_notifier`
/// PUTs the whole system on each change).
#[derive(Clone, Default)]
pub struct Notifications(pub Arc<Mutex<Vec<Value>>>);

impl Notifications {
    /// Listens on loopback, on a thread of its own (sushy waits for the answer inside the
    /// request it is serving, so the recorder must not share the test's runtime).
    pub fn start() -> (Notifications, String) {
        let notifications = Notifications::default();
        let store = notifications.clone();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/notify", listener.local_addr().unwrap());
        listener.set_nonblocking(true).unwrap();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                let record = move |axum::Json(body): axum::Json<Value>| async move {
                    store.0.lock().unwrap().push(body);
                    axum::http::StatusCode::NO_CONTENT
                };
                let app = axum::Router::new().route("/notify", axum::routing::put(record));
                axum::serve(listener, app).await.unwrap();
            });
        });
        (notifications, url)
    }

    pub fn of(&self, uuid: &str) -> Vec<Value> {
        self.0.lock().unwrap().iter().filter(|s| s["uuid"] == uuid).cloned().collect()
    }
}

/// A running `sushy-emulator --fake` on a loopback port, over HTTPS; killed when dropped (its
/// directory, with `emulator.log`, kept when the test failed).
pub struct Emulator {
    child: Child,
    dir: Option<tempfile::TempDir>,
    pub port: u16,
}

impl Emulator {
    pub fn start(pki: &Pki, notify_url: &str) -> Emulator {
        let venv = sushy_venv();
        let dir = tempfile::tempdir().unwrap();
        let path = |name: &str| dir.path().join(name).display().to_string();
        std::fs::write(path("server.pem"), &pki.server_pem).unwrap();
        std::fs::write(path("server.key"), &pki.server_key_pem).unwrap();
        std::fs::create_dir_all(path("tmp")).unwrap();
        std::fs::write(path("htpasswd"), format!("{USERNAME}:{}\n", bcrypt(&venv, PASSWORD))).unwrap();
        let port = free_port();
        let system = |uuid: &str, name: &str, mac: &str| {
            format!(
                "{{'uuid': {uuid:?}, 'name': {name:?}, 'power_state': 'Off', 'external_notifier': True, \
                 'nics': [{{'mac': {mac:?}, 'ip': '192.0.2.10'}}]}}"
            )
        };
        let config = format!(
            "SUSHY_EMULATOR_LISTEN_IP = '127.0.0.1'\n\
             SUSHY_EMULATOR_LISTEN_PORT = {port}\n\
             SUSHY_EMULATOR_SSL_CERT = {cert:?}\n\
             SUSHY_EMULATOR_SSL_KEY = {key:?}\n\
             SUSHY_EMULATOR_AUTH_FILE = {auth:?}\n\
             SUSHY_EMULATOR_STATE_DIR = {state:?}\n\
             SUSHY_EMULATOR_FAKE_DRIVER = True\n\
             EXTERNAL_NOTIFICATION_URL = {notify_url:?}\n\
             SUSHY_EMULATOR_FAKE_SYSTEMS = [{a}, {b}, {c}]\n",
            cert = path("server.pem"),
            key = path("server.key"),
            auth = path("htpasswd"),
            state = path("state"),
            a = system(SYSTEM_A, "node-a", "52:54:00:00:0a:01"),
            b = system(SYSTEM_B, "node-b", "52:54:00:00:0b:02"),
            c = system(SYSTEM_C, "node-c", "52:54:00:00:0c:03"),
        );
        std::fs::write(path("emulator.conf"), config).unwrap();
        let log = std::fs::File::create(path("emulator.log")).unwrap();
        let mut command = Command::new(venv.join("bin/sushy-emulator"));
        command.args(["--fake", "--config", &path("emulator.conf")]);
        // Images it downloads go to the test's directory; the loopback image server and the
        // recorder are reached directly, whatever proxy the environment names.
        command.env("TMPDIR", path("tmp")).env("NO_PROXY", "127.0.0.1,localhost").env("no_proxy", "127.0.0.1,localhost");
        for proxy in ["http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"] {
            command.env_remove(proxy);
        }
        let child =
            command.stdin(Stdio::null()).stdout(log.try_clone().unwrap()).stderr(log).spawn().expect("start sushy-emulator");
        let mut emulator = Emulator { child, dir: Some(dir), port };
        let deadline = Instant::now() + Duration::from_secs(EMULATOR_START_S);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Some(status) = emulator.child.try_wait().unwrap() {
                panic!("sushy-emulator ended ({status}) before it listened:\n{}", emulator.log());
            }
            assert!(Instant::now() < deadline, "sushy-emulator did not listen in {EMULATOR_START_S} s:\n{}", emulator.log());
            std::thread::sleep(Duration::from_millis(100));
        }
        emulator
    }

    pub fn log(&self) -> String {
        let dir = self.dir.as_ref().unwrap();
        std::fs::read_to_string(dir.path().join("emulator.log")).unwrap_or_default()
    }

    pub fn target(&self, tls: BmcTls, system: Option<&str>) -> BmcTarget {
        BmcTarget {
            address: url::Url::parse(&format!("https://localhost:{}", self.port)).unwrap(),
            system_path: system.map(|uuid| format!("/redfish/v1/Systems/{uuid}")),
            username: USERNAME.into(),
            password: PASSWORD.into(),
            tls,
        }
    }

    pub fn bmc(&self, tls: BmcTls, system: Option<&str>) -> RedfishBmc {
        RedfishBmc::new(&self.target(tls, system), &loopback_named()).expect("a Redfish client")
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let log = self.log();
            let kept = self.dir.take().unwrap().keep();
            eprintln!("test failed: kept {} (emulator.log); the emulator's log ends:\n{}", kept.display(), tail(&log, 60));
        }
    }
}

pub fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// `password`'s bcrypt hash, by the venv's own bcrypt (what sushy checks it with); the
/// password goes on standard input, not the command line.
pub fn bcrypt(venv: &Path, password: &str) -> String {
    use std::io::Write;
    let mut child = Command::new(venv.join("bin/python"))
        .args(["-c", "import bcrypt, sys; print(bcrypt.hashpw(sys.stdin.buffer.read(), bcrypt.gensalt(rounds=4)).decode())"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the sushy venv's python");
    child.stdin.take().unwrap().write_all(password.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "bcrypt: {}", String::from_utf8_lossy(&out.stderr));
    let hash = BufReader::new(&out.stdout[..]).lines().next().unwrap().unwrap();
    assert!(hash.starts_with("$2"), "{hash}");
    hash
}

/// Polls `system()` until its power state is `want` (or the time is up); the states seen.
pub async fn wait_power(bmc: &RedfishBmc, want: PowerState) -> Vec<Option<PowerState>> {
    let deadline = Instant::now() + Duration::from_secs(POWER_APPLIES_S);
    let mut seen = Vec::new();
    loop {
        let power = bmc.system().await.expect("system").power_state;
        if seen.last() != Some(&power) {
            seen.push(power);
        }
        if power == Some(want) {
            return seen;
        }
        assert!(Instant::now() < deadline, "the power state is not {want:?} after {POWER_APPLIES_S} s; seen {seen:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The power states sushy saved for `uuid`, in order, with repeats folded.
pub fn power_history(notifications: &Notifications, uuid: &str) -> Vec<String> {
    let mut history: Vec<String> = Vec::new();
    for state in notifications.of(uuid) {
        let power = state["power_state"].as_str().unwrap_or_default().to_owned();
        if history.last() != Some(&power) {
            history.push(power);
        }
    }
    history
}

/// The BMC networks of the tests: the emulator's address, named exactly (`--bmc-allow-network
/// 127.0.0.1/32`); loopback is refused otherwise.
pub fn loopback_named() -> bc_bmc::BmcNetworks {
    bc_bmc::BmcNetworks::parse(&["127.0.0.1/32"]).expect("a network")
}
