//! An HTTP/2 client that ignores the server's limits: it writes the preface and then `HEADERS`
//! frames opening one stream after another as fast as it can, whatever the server's
//! `SETTINGS_MAX_CONCURRENT_STREAMS` says, and counts what the server answers. Raw frames (no
//! `h2` client, which would queue streams past the server's limit), so what it measures is the
//! server's defence. Shared by the agents' endpoint tests (`agents_hardening.rs`) and the
//! `agents` bench (`#[path]`).
#![allow(dead_code)]

use std::collections::BTreeSet;
use std::time::Duration;

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// HTTP/2's connection preface.
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADERS: u8 = 0x1;
const FRAME_RST_STREAM: u8 = 0x3;
const FRAME_SETTINGS: u8 = 0x4;
const FRAME_GOAWAY: u8 = 0x7;
const FLAG_END_HEADERS: u8 = 0x4;
/// `RST_STREAM`'s code for a stream the server would not open.
pub const REFUSED_STREAM: u32 = 0x7;
/// `GOAWAY`'s code for a peer that misbehaves.
pub const ENHANCE_YOUR_CALM: u32 = 0xb;
/// Frames written per `write_all`.
const FRAMES_PER_WRITE: u32 = 256;

/// What the server answered a flood.
#[derive(Debug, Default)]
pub struct FloodReport {
    /// `HEADERS` frames written (not all may have reached the server).
    pub sent: u32,
    /// Streams the server answered with `HEADERS`: the ones it opened.
    pub accepted: BTreeSet<u32>,
    /// Streams reset with `REFUSED_STREAM`.
    pub refused: usize,
    /// Streams reset with another code.
    pub reset_otherwise: usize,
    /// The code of the server's `GOAWAY`, if it sent one.
    pub goaway: Option<u32>,
    /// Whether the server closed the connection within the wait.
    pub closed: bool,
}

fn frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    let len = payload.len() as u32;
    out.extend_from_slice(&len.to_be_bytes()[1..]);
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

fn literal(out: &mut Vec<u8>, bytes: &[u8]) {
    assert!(bytes.len() < 127);
    out.push(bytes.len() as u8);
    out.extend_from_slice(bytes);
}

/// A gRPC call's request head (HPACK, literals without indexing, no Huffman).
fn request_head(path: &str, tls: bool) -> Vec<u8> {
    let mut block = vec![0x83, if tls { 0x87 } else { 0x86 }]; // :method POST, :scheme
    block.push(0x04); // :path, name indexed
    literal(&mut block, path.as_bytes());
    block.push(0x01); // :authority, name indexed
    literal(&mut block, b"agents");
    for (name, value) in [(&b"content-type"[..], &b"application/grpc"[..]), (b"te", b"trailers")] {
        block.push(0x00);
        literal(&mut block, name);
        literal(&mut block, value);
    }
    block
}

/// The preface and an empty `SETTINGS`: what a client sends before its first stream.
pub fn preface() -> Vec<u8> {
    let mut out = PREFACE.to_vec();
    frame(&mut out, FRAME_SETTINGS, 0, 0, &[]);
    out
}

/// Opens `streams` streams of `path` on `io` (after the preface), then waits at most `wait`
/// for the server to close the connection.
pub async fn flood<S>(io: S, streams: u32, path: &str, tls: bool, wait: Duration) -> FloodReport
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (mut reader, mut writer) = tokio::io::split(io);
    let head = request_head(path, tls);
    let write = tokio::spawn(async move {
        let mut sent = 0u32;
        if writer.write_all(&preface()).await.is_err() {
            return (sent, writer);
        }
        let mut batch = Vec::new();
        while sent < streams {
            batch.clear();
            let upto = (sent + FRAMES_PER_WRITE).min(streams);
            for i in sent..upto {
                frame(&mut batch, FRAME_HEADERS, FLAG_END_HEADERS, 2 * i + 1, &head);
            }
            if writer.write_all(&batch).await.is_err() {
                break;
            }
            sent = upto;
        }
        let _ = writer.flush().await;
        (sent, writer)
    });
    let shared = std::sync::Arc::new(std::sync::Mutex::new(FloodReport::default()));
    let seen = shared.clone();
    let read = tokio::spawn(async move {
        let mut header = [0u8; 9];
        let mut payload = Vec::new();
        loop {
            if reader.read_exact(&mut header).await.is_err() {
                seen.lock().unwrap().closed = true;
                return;
            }
            let len = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
            let stream = u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & 0x7fff_ffff;
            payload.resize(len, 0);
            if reader.read_exact(&mut payload).await.is_err() {
                seen.lock().unwrap().closed = true;
                return;
            }
            let mut report = seen.lock().unwrap();
            match header[3] {
                FRAME_HEADERS => {
                    report.accepted.insert(stream);
                }
                FRAME_RST_STREAM if len >= 4 => {
                    let code = u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]);
                    if code == REFUSED_STREAM {
                        report.refused += 1;
                    } else {
                        report.reset_otherwise += 1;
                    }
                }
                FRAME_GOAWAY if len >= 8 => {
                    report.goaway = Some(u32::from_be_bytes([payload[4], payload[5], payload[6], payload[7]]));
                }
                _ => {}
            }
        }
    });
    let (sent, writer) = write.await.unwrap();
    let abort = read.abort_handle();
    if tokio::time::timeout(wait, read).await.is_err() {
        abort.abort();
    }
    drop(writer);
    let mut report = std::mem::take(&mut *shared.lock().unwrap());
    report.sent = sent;
    report
}

/// Accepts any server certificate: an attacker, they do not trust it.
#[derive(Debug)]
struct AnyCertificate;

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Ok(HandshakeSignatureValid::assertion())
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        signature: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.verify_tls12_signature(message, cert, signature)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        rustls::crypto::ring::default_provider().signature_verification_algorithms.supported_schemes()
    }
}

pub async fn tls_connect(addr: std::net::SocketAddr) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let mut config = rustls::ClientConfig::builder()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCertificate))
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    tokio_rustls::TlsConnector::from(Arc::new(config)).connect(ServerName::try_from("agents").unwrap(), tcp).await
}
