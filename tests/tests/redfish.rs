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

use std::time::{Duration, Instant};

use bc_bmc::redfish::RedfishBmc;
use bc_bmc::{Bmc, BmcError, BmcTarget, BmcTls, BootSource, PowerState, ResetType};
use bc_tests::ImageServer;
use bc_tests::sushy::{Emulator, Notifications, PASSWORD, SYSTEM_A, SYSTEM_B, USERNAME, pki, power_history, wait_power};
use serde_json::Value;

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
    // Another CA, another pin, the right CA for another name (the emulator's address by IP,
    // which its certificate does not name): no connection, each with the one text of a failed
    // TLS session (which does not tell a certificate refused from a closed port; the cause is
    // in the log).
    let no_session = format!("the BMC is unreachable: GET /redfish/v1/Systems/{SYSTEM_B}: {}", bc_bmc::redfish::NO_SESSION);
    let wrong_ca = power(emulator.bmc(BmcTls::CaBundle { pem: pki.other_ca_pem.clone() }, Some(SYSTEM_B))).await;
    let Err(BmcError::Unreachable(_)) = &wrong_ca else { panic!("{wrong_ca:?}") };
    let other_pin = format!("sha256/{}", "A".repeat(43) + "=");
    let wrong_pin = power(emulator.bmc(BmcTls::Pin { pin: other_pin }, Some(SYSTEM_B))).await;
    let mut by_ip = emulator.target(BmcTls::CaBundle { pem: pki.ca_pem.clone() }, Some(SYSTEM_B));
    by_ip.address = url::Url::parse(&format!("https://127.0.0.1:{}", emulator.port)).unwrap();
    let wrong_name = power(RedfishBmc::new(&by_ip, &bc_tests::sushy::loopback_named()).unwrap()).await;
    for refused in [&wrong_ca, &wrong_pin, &wrong_name] {
        assert_eq!(refused.as_ref().map_err(ToString::to_string).unwrap_err(), no_session, "{refused:?}");
    }

    // A wrong password: Unauthorized, with sushy's message and without either password.
    let mut target = emulator.target(BmcTls::CaBundle { pem: pki.ca_pem.clone() }, Some(SYSTEM_B));
    target.password = "not the password".into();
    let refused = power(RedfishBmc::new(&target, &bc_tests::sushy::loopback_named()).unwrap()).await;
    let Err(BmcError::Unauthorized(message)) = &refused else { panic!("{refused:?}") };
    assert!(message.contains("401") && message.contains("Incorrect username or password"), "{message}");
    assert!(!message.contains("not the password") && !message.contains(PASSWORD), "{message}");

    // No system path, and the BMC has three (the test emulator's systems): named, and nothing guessed.
    let several = power(emulator.bmc(BmcTls::CaBundle { pem: pki.ca_pem.clone() }, None)).await;
    let Err(BmcError::Protocol(message)) = &several else { panic!("{several:?}") };
    assert!(message.contains(SYSTEM_A) && message.contains(SYSTEM_B), "{message}");

    // Plain HTTP is refused before anything is sent.
    let mut plain = emulator.target(BmcTls::Insecure, Some(SYSTEM_B));
    plain.address = url::Url::parse(&format!("http://127.0.0.1:{}", emulator.port)).unwrap();
    let Err(BmcError::Protocol(message)) = RedfishBmc::new(&plain, &bc_tests::sushy::loopback_named()) else {
        panic!("http:// accepted")
    };
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
    let bmc = RedfishBmc::new(&target, &bc_tests::sushy::loopback_named()).unwrap().with_timeout(timeout);
    let started = Instant::now();
    let silent = bmc.system().await;
    let took = started.elapsed();
    assert!(matches!(silent, Err(BmcError::Timeout(_))), "{silent:?}");
    // A request timeout (not the connect bound: that is `Unreachable`), and the one given, not
    // the default: at least 2 s, and well under the default's 30 s (a bound on which timeout
    // fired, not on speed).
    assert!(took >= timeout, "{took:?}");
    assert!(took < Duration::from_secs(bc_bmc::REQUEST_TIMEOUT_S), "{took:?}");
    let reset = bmc.reset(ResetType::On).await;
    assert!(matches!(reset, Err(BmcError::Timeout(_))), "{reset:?}");
}
