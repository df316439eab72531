//! The Redfish client's errors and where it connects, against local servers: an
//! address outside the BMC networks refused before any connection (a name that resolves to
//! loopback included), a non-BMC's body never carried in an error, one text for every failure
//! to get a TLS session whatever the port does, and errors that do not depend on the password.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::Arc;

use bc_bmc::redfish::{NO_SESSION, RedfishBmc};
use bc_bmc::{Bmc, BmcError, BmcNetworks, BmcTarget, BmcTls};

/// What the local server answers every request with: a status line and a body.
type Answer = (&'static str, String);

/// An HTTPS server on 127.0.0.1 answering every request with `answer`, one thread per
/// connection; its certificate is self-signed.
fn https_server(answer: Answer) -> u16 {
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).unwrap().self_signed(&key).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.der().clone()], rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).unwrap())
        .unwrap();
    let config = Arc::new(config);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            let config = config.clone();
            let answer = answer.clone();
            std::thread::spawn(move || {
                let connection = rustls::ServerConnection::new(config).unwrap();
                let mut tls = rustls::StreamOwned::new(connection, stream);
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    match tls.read(&mut byte) {
                        Ok(1) => head.push(byte[0]),
                        _ => return,
                    }
                }
                let (status, body) = answer;
                let reply = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = tls.write_all(reply.as_bytes());
                let _ = tls.flush();
                tls.conn.send_close_notify();
                let _ = tls.flush();
            });
        }
    });
    port
}

/// A port that accepts connections and answers plain text, not TLS.
fn plain_server() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let _ = stream.write_all(b"SSH-2.0-OpenSSH_9.6 internal-service\r\n");
        }
    });
    port
}

/// A port nothing listens on.
fn closed_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn loopback_named() -> BmcNetworks {
    BmcNetworks::parse(&["127.0.0.1/32"]).unwrap()
}

fn target(address: &str, password: &str, tls: BmcTls) -> BmcTarget {
    BmcTarget {
        address: url::Url::parse(address).unwrap(),
        system_path: None,
        username: "admin".into(),
        password: password.into(),
        tls,
    }
}

async fn system_error(address: &str, password: &str, tls: BmcTls) -> BmcError {
    let bmc = RedfishBmc::new(&target(address, password, tls), &loopback_named()).unwrap();
    bmc.system().await.unwrap_err()
}

#[tokio::test]
async fn a_bmc_on_loopback_is_refused_before_any_connection_a_name_that_resolves_to_it_included() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let none = BmcNetworks::default();
    // An address literal: refused as the client is made.
    let literal = RedfishBmc::new(&target(&format!("https://127.0.0.1:{port}"), "pw", BmcTls::Insecure), &none);
    assert!(matches!(literal, Err(BmcError::AddressRefused(_))), "{literal:?}");
    // A name that resolves to loopback: refused when a request resolves it, every address it
    // stands for outside the networks (the client is made: names are checked at connect time).
    let by_name = RedfishBmc::new(&target(&format!("https://localhost:{port}"), "pw", BmcTls::Insecure), &none).unwrap();
    let refused = by_name.system().await.unwrap_err();
    assert!(matches!(refused, BmcError::AddressRefused(_)), "{refused:?}");
    assert_eq!(refused.kind(), "address-refused");
    assert!(!refused.to_string().contains("127.0.0.1"), "what the name resolves to is not told: {refused}");
    // Nothing connected: a connection would be waiting in the listener's backlog by now.
    let accepted = listener.accept();
    assert!(
        accepted.as_ref().is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock),
        "a refused address was connected to: {accepted:?}"
    );
    // Named exactly, the same address is reached.
    let reached = RedfishBmc::new(&target(&format!("https://127.0.0.1:{port}"), "pw", BmcTls::Insecure), &loopback_named());
    assert!(reached.is_ok(), "{reached:?}");
}

#[tokio::test]
async fn a_non_bmcs_body_is_never_in_an_error_only_a_redfish_errors_message() {
    let secret = "db_password=hunter2-internal";
    let html = https_server(("500 Internal Server Error", format!("<html>{secret}</html>")));
    let json = https_server(("404 Not Found", format!(r#"{{"config": "{secret}"}}"#)));
    let redfish = https_server((
        "400 Bad Request",
        r#"{"error": {"code": "Base.1.8.GeneralError", "message": "The request failed."}}"#.to_owned(),
    ));
    for port in [html, json] {
        let error = system_error(&format!("https://127.0.0.1:{port}"), "pw", BmcTls::Insecure).await;
        let text = error.to_string();
        assert!(!text.contains("hunter2") && !text.contains("db_password"), "{text}");
        assert!(matches!(error, BmcError::Refused { .. }), "{error:?}");
    }
    let error = system_error(&format!("https://127.0.0.1:{redfish}"), "pw", BmcTls::Insecure).await;
    assert_eq!(
        error,
        BmcError::Refused { status: 400, message: "GET /redfish/v1/Systems: The request failed.".into() },
        "the Redfish error's message is carried"
    );
}

#[tokio::test]
async fn every_failure_to_get_a_tls_session_reads_the_same_whatever_the_port_does() {
    let wrong_pin = BmcTls::Pin { pin: format!("sha256/{}", "A".repeat(43) + "=") };
    let tls_port = https_server(("200 OK", "{}".into()));
    let mut texts = Vec::new();
    for (what, port, tls) in [
        ("closed", closed_port(), BmcTls::Insecure),
        ("not TLS", plain_server(), BmcTls::Insecure),
        ("another certificate", tls_port, wrong_pin),
    ] {
        let error = system_error(&format!("https://127.0.0.1:{port}"), "pw", tls).await;
        assert_eq!(error.kind(), "unreachable", "{what}: {error:?}");
        texts.push(error.to_string());
    }
    assert!(texts.iter().all(|t| *t == texts[0]), "the texts tell the ports apart: {texts:#?}");
    assert_eq!(texts[0], format!("the BMC is unreachable: GET /redfish/v1/Systems: {NO_SESSION}"));
    assert!(texts[0].contains("--bmc-pin"), "the self-signed certificate's hint: {}", texts[0]);
}

/// Errors are made of the request, the status and the BMC's message: never of the password,
/// so a one-letter password is no more visible in them than a long one (a substring scrub
/// showed it: `htt<redacted>s`).
#[tokio::test]
async fn a_one_letter_password_is_never_visible_in_any_error() {
    let unauthorized = https_server((
        "401 Unauthorized",
        r#"{"error": {"code": "Base.1.8.InsufficientPrivilege", "message": "Access denied. Please supply credentials."}}"#
            .to_owned(),
    ));
    let failing = https_server(("503 Service Unavailable", "upstream is down".into()));
    let addresses = [
        format!("https://127.0.0.1:{unauthorized}"),
        format!("https://127.0.0.1:{failing}"),
        format!("https://127.0.0.1:{}", closed_port()),
    ];
    for address in &addresses {
        let mut texts = Vec::new();
        for password in ["p", "s", "e", "q"] {
            let error = system_error(address, password, BmcTls::Insecure).await;
            let text = error.to_string();
            assert!(!text.contains("redacted"), "{password:?}: {text}");
            texts.push(text);
        }
        assert!(texts.iter().all(|t| *t == texts[0]), "an error depends on the password: {texts:#?}");
    }
    let debug = format!("{:?}", RedfishBmc::new(&target(&addresses[0], "p", BmcTls::Insecure), &loopback_named()).unwrap());
    assert!(!debug.contains("\"p\""), "{debug}");
}
