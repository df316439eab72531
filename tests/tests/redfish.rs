//! The Redfish client (`bc_bmc::redfish::RedfishBmc`) against a BMC it was not written with:
//! OpenStack's sushy-tools emulator (`sushy-emulator --fake`, its fake system driver, from the
//! virtual environment `make sushy-venv` makes) over HTTPS with a certificate this test issues
//! from its own CA, behind HTTP basic auth (an htpasswd file, bcrypt).
//!
//! What the emulator did is observed on the emulator's side: its fake systems are set to send
//! every change of their state (`external_notifier`) to a recorder here, so a power change, a
//! reboot's off-then-on, the boot device and the inserted image are seen as sushy holds them,
//! not only as the client reads them back. Power applies 1 to 11 s after a reset, as on a real
//! BMC, so the tests poll `system()`.
//!
//! Missing the emulator, a test fails with what to run; it never skips.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bc_bmc::redfish::RedfishBmc;
use bc_bmc::{Bmc, BmcError, BmcTarget, BmcTls, BootSource, PowerState, ResetType};
use bc_tests::{ImageServer, free_port};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use serde_json::Value;

const USERNAME: &str = "admin";
const PASSWORD: &str = "correct horse battery staple";

/// The emulator's two fake systems (uuids are what sushy names them by).
const SYSTEM_A: &str = "5d7a1a36-1f0b-4d9e-9a43-000000000a01";
const SYSTEM_B: &str = "5d7a1a36-1f0b-4d9e-9a43-000000000b02";

/// How long the emulator may take to listen.
const EMULATOR_START_S: u64 = 30;

/// How long a power change may take to show: sushy's fake applies it 1 to 11 s after the reset.
const POWER_APPLIES_S: u64 = 30;

/// The sushy-tools virtual environment `make sushy-venv` makes (`BC_SUSHY_VENV` names another).
fn sushy_venv() -> PathBuf {
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
fn ca(name: &str) -> (String, Issuer<'static, KeyPair>) {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    let key = KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    (cert.pem(), Issuer::new(params, key))
}

/// The test's certificates: the CA that signed the emulator's certificate, another CA, the
/// emulator's certificate and key, and the pin of its key.
struct Pki {
    ca_pem: String,
    other_ca_pem: String,
    server_pem: String,
    server_key_pem: String,
    pin: String,
}

fn pki() -> Pki {
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
struct Notifications(Arc<Mutex<Vec<Value>>>);

impl Notifications {
    /// Listens on loopback, on a thread of its own (sushy waits for the answer inside the
    /// request it is serving, so the recorder must not share the test's runtime).
    fn start() -> (Notifications, String) {
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

    fn of(&self, uuid: &str) -> Vec<Value> {
        self.0.lock().unwrap().iter().filter(|s| s["uuid"] == uuid).cloned().collect()
    }
}

/// A running `sushy-emulator --fake` on a loopback port, over HTTPS; killed when dropped (its
/// directory, with `emulator.log`, kept when the test failed).
struct Emulator {
    child: Child,
    dir: Option<tempfile::TempDir>,
    port: u16,
}

impl Emulator {
    fn start(pki: &Pki, notify_url: &str) -> Emulator {
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
             SUSHY_EMULATOR_FAKE_SYSTEMS = [{a}, {b}]\n",
            cert = path("server.pem"),
            key = path("server.key"),
            auth = path("htpasswd"),
            state = path("state"),
            a = system(SYSTEM_A, "node-a", "52:54:00:00:0a:01"),
            b = system(SYSTEM_B, "node-b", "52:54:00:00:0b:02"),
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

    fn log(&self) -> String {
        let dir = self.dir.as_ref().unwrap();
        std::fs::read_to_string(dir.path().join("emulator.log")).unwrap_or_default()
    }

    fn target(&self, tls: BmcTls, system: Option<&str>) -> BmcTarget {
        BmcTarget {
            address: url::Url::parse(&format!("https://localhost:{}", self.port)).unwrap(),
            system_path: system.map(|uuid| format!("/redfish/v1/Systems/{uuid}")),
            username: USERNAME.into(),
            password: PASSWORD.into(),
            tls,
        }
    }

    fn bmc(&self, tls: BmcTls, system: Option<&str>) -> RedfishBmc {
        RedfishBmc::new(&self.target(tls, system)).expect("a Redfish client")
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

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// `password`'s bcrypt hash, by the venv's own bcrypt (what sushy checks it with); the
/// password goes on standard input, not the command line.
fn bcrypt(venv: &Path, password: &str) -> String {
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
async fn wait_power(bmc: &RedfishBmc, want: PowerState) -> Vec<Option<PowerState>> {
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
fn power_history(notifications: &Notifications, uuid: &str) -> Vec<String> {
    let mut history: Vec<String> = Vec::new();
    for state in notifications.of(uuid) {
        let power = state["power_state"].as_str().unwrap_or_default().to_owned();
        if history.last() != Some(&power) {
            history.push(power);
        }
    }
    history
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn power_boot_override_and_virtual_media_through_the_client_as_the_emulator_saw_them() {
    let pki = pki();
    let (notifications, notify_url) = Notifications::start();
    let emulator = Emulator::start(&pki, &notify_url);
    let bmc = emulator.bmc(BmcTls::CaBundle { pem: pki.ca_pem.clone() }, Some(SYSTEM_A));

    let info = bmc.system().await.expect("system");
    assert_eq!(info.power_state, Some(PowerState::Off));
    assert_eq!(info.uuid.as_deref(), Some(SYSTEM_A));
    assert_eq!(info.manufacturer.as_deref(), Some("Sushy Emulator"));
    assert_eq!((info.boot_once, info.media_image.as_deref()), (None, None));

    // Power on, then off: each applies late, and the emulator saves it.
    bmc.reset(ResetType::On).await.expect("power on");
    wait_power(&bmc, PowerState::On).await;
    bmc.reset(ResetType::ForceOff).await.expect("power off");
    wait_power(&bmc, PowerState::Off).await;
    assert_eq!(power_history(&notifications, SYSTEM_A), ["Off", "On", "Off"], "{:?}", notifications.of(SYSTEM_A));

    // A reboot: on first, then ForceRestart, which sushy saves as off with a restart pending,
    // then on again.
    bmc.reset(ResetType::On).await.expect("power on");
    wait_power(&bmc, PowerState::On).await;
    let before = notifications.of(SYSTEM_A).len();
    bmc.reset(ResetType::ForceRestart).await.expect("reboot");
    wait_power(&bmc, PowerState::On).await;
    let reboot: Vec<Value> = notifications.of(SYSTEM_A)[before..].to_vec();
    let off_pending_restart = reboot
        .iter()
        .position(|s| s["power_state"] == "Off" && s["pending_power"]["power_state"] == "ForceRestart")
        .unwrap_or_else(|| panic!("no off-with-restart-pending state saved: {reboot:?}"));
    assert!(reboot[off_pending_restart..].iter().any(|s| s["power_state"] == "On"), "{reboot:?}");
    assert!(notifications.of(SYSTEM_B).is_empty(), "the other system was left alone");

    // The one-time boot override: the emulator sets the device. Its system resource reports
    // every override as `Continuous` (sushy's template hard-codes it), and the client counts
    // only a `Once` override as pending, so `boot_once` stays empty against sushy (the unit
    // tests hold the `Once` mapping).
    bmc.set_boot_once(BootSource::Cd).await.expect("boot once from the CD");
    assert_eq!(notifications.of(SYSTEM_A).last().unwrap()["boot_device"], "Cd");
    bmc.set_boot_once(BootSource::Pxe).await.expect("boot once from the network");
    assert_eq!(notifications.of(SYSTEM_A).last().unwrap()["boot_device"], "Pxe");
    assert_eq!(bmc.system().await.unwrap().boot_once, None);

    // Virtual media: sushy downloads the image; inserting another ejects the first; ejecting
    // an empty drive is not an error.
    let first = ImageServer::start("first.iso", b"an iso, first".to_vec());
    let second = ImageServer::start("second.iso", b"an iso, second".to_vec());
    bmc.insert_media(&first.url).await.expect("insert");
    assert_eq!(first.served(), 1, "sushy fetched the image");
    assert_eq!(bmc.system().await.unwrap().media_image.as_deref(), Some(first.url.as_str()));
    bmc.insert_media(&second.url).await.expect("insert another");
    assert_eq!((first.served(), second.served()), (1, 1));
    assert_eq!(bmc.system().await.unwrap().media_image.as_deref(), Some(second.url.as_str()));
    let boot_image = notifications.of(SYSTEM_A).last().unwrap()["boot_image"]["Cd"].clone();
    assert!(boot_image[0].as_str().is_some_and(|file| file.ends_with("second.iso")), "{boot_image}");
    bmc.eject_media().await.expect("eject");
    assert_eq!(bmc.system().await.unwrap().media_image, None);
    bmc.eject_media().await.expect("ejecting an empty drive");

    // An image sushy cannot fetch: the BMC's refusal, with its message.
    let refused = bmc.insert_media("http://127.0.0.1:1/missing.iso").await.unwrap_err();
    let BmcError::Refused { status, message } = &refused else { panic!("{refused:?}") };
    assert!(*status >= 400, "{refused}");
    assert!(message.contains("InsertMedia"), "{message}");
    assert!(!refused.to_string().contains(PASSWORD));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_and_credentials_are_checked_as_the_target_says() {
    let pki = pki();
    let (_notifications, notify_url) = Notifications::start();
    let emulator = Emulator::start(&pki, &notify_url);
    let power = |bmc: RedfishBmc| async move { bmc.system().await.map(|info| info.power_state) };

    // Its CA, its key's pin, or nothing checked: each reaches the system.
    for tls in [BmcTls::CaBundle { pem: pki.ca_pem.clone() }, BmcTls::Pin { pin: pki.pin.clone() }, BmcTls::Insecure] {
        let mode = format!("{tls:?}");
        assert_eq!(power(emulator.bmc(tls, Some(SYSTEM_B))).await, Ok(Some(PowerState::Off)), "{mode}");
    }
    // Another CA, another pin: no connection.
    let wrong_ca = power(emulator.bmc(BmcTls::CaBundle { pem: pki.other_ca_pem.clone() }, Some(SYSTEM_B))).await;
    let Err(BmcError::Unreachable(message)) = &wrong_ca else { panic!("{wrong_ca:?}") };
    assert!(message.to_lowercase().contains("certificate"), "{message}");
    let other_pin = format!("sha256/{}", "A".repeat(43) + "=");
    let wrong_pin = power(emulator.bmc(BmcTls::Pin { pin: other_pin }, Some(SYSTEM_B))).await;
    let Err(BmcError::Unreachable(message)) = &wrong_pin else { panic!("{wrong_pin:?}") };
    assert!(message.contains(&format!("the BMC's certificate key is {}, not the pinned key", pki.pin)), "{message}");
    // The right CA, another name (the emulator's address by IP, which its certificate does not
    // name): the host name is checked too.
    let mut by_ip = emulator.target(BmcTls::CaBundle { pem: pki.ca_pem.clone() }, Some(SYSTEM_B));
    by_ip.address = url::Url::parse(&format!("https://127.0.0.1:{}", emulator.port)).unwrap();
    let wrong_name = power(RedfishBmc::new(&by_ip).unwrap()).await;
    let Err(BmcError::Unreachable(message)) = &wrong_name else { panic!("{wrong_name:?}") };
    assert!(message.contains("NotValidForName") || message.contains("not valid for name"), "{message}");

    // A wrong password: Unauthorized, with sushy's message and without either password.
    let mut target = emulator.target(BmcTls::CaBundle { pem: pki.ca_pem.clone() }, Some(SYSTEM_B));
    target.password = "not the password".into();
    let refused = power(RedfishBmc::new(&target).unwrap()).await;
    let Err(BmcError::Unauthorized(message)) = &refused else { panic!("{refused:?}") };
    assert!(message.contains("401") && message.contains("Incorrect username or password"), "{message}");
    assert!(!message.contains("not the password") && !message.contains(PASSWORD), "{message}");

    // No system path, and the BMC has two: named, and nothing guessed.
    let several = power(emulator.bmc(BmcTls::CaBundle { pem: pki.ca_pem.clone() }, None)).await;
    let Err(BmcError::Protocol(message)) = &several else { panic!("{several:?}") };
    assert!(message.contains(SYSTEM_A) && message.contains(SYSTEM_B), "{message}");

    // Plain HTTP is refused before anything is sent.
    let mut plain = emulator.target(BmcTls::Insecure, Some(SYSTEM_B));
    plain.address = url::Url::parse(&format!("http://127.0.0.1:{}", emulator.port)).unwrap();
    let Err(BmcError::Protocol(message)) = RedfishBmc::new(&plain) else { panic!("http:// accepted") };
    assert!(message.contains("https://"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bmc_that_accepts_and_never_answers_times_out() {
    // Accepts every connection and holds it open, silent (the TLS handshake never starts).
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            held.push(stream);
        }
    });
    let target = BmcTarget {
        address: url::Url::parse(&format!("https://127.0.0.1:{port}")).unwrap(),
        system_path: Some("/redfish/v1/Systems/1".into()),
        username: USERNAME.into(),
        password: PASSWORD.into(),
        tls: BmcTls::Insecure,
    };
    let timeout = Duration::from_secs(2);
    let bmc = RedfishBmc::new(&target).unwrap().with_timeout(timeout);
    let started = Instant::now();
    let silent = bmc.system().await;
    let took = started.elapsed();
    assert!(matches!(silent, Err(BmcError::Timeout(_))), "{silent:?}");
    assert!(took >= timeout && took < timeout + Duration::from_secs(5), "{took:?}");
    assert!(took < Duration::from_secs(bc_bmc::REQUEST_TIMEOUT_S));
    let reset = bmc.reset(ResetType::On).await;
    assert!(matches!(reset, Err(BmcError::Timeout(_))), "{reset:?}");
}
