//! The connection to the gateway: gRPC over TLS whose server certificate is accepted only when
//! its key matches the pinned SPKI hash (`serving_ca_spki_pin`), whatever CA signed it; or h2c,
//! only to a loopback address (`dev`). Anything else is refused before a byte is sent. Over TLS
//! the channel presents the node certificate, when the node has one
//! ([`crate::node_cert::NodeCertificates`]).

use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use rustls::client::ResolvesClientCert;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::{Channel, Endpoint};

/// Connecting (TCP and TLS) gives up after this.
pub const CONNECT_TIMEOUT_MS: u64 = 10_000;

/// Where the gateway is and how it is trusted.
#[derive(Clone, Debug)]
pub struct Gateway {
    pub host: String,
    pub port: u16,
    /// `None`: h2c (loopback only).
    pub pin: Option<String>,
}

impl Gateway {
    /// `https://HOST:PORT` with a pin, or `http://HOST:PORT` to a loopback address.
    pub fn parse(url: &str, pin: Option<&str>) -> Result<Self, String> {
        let (scheme, rest) = url.split_once("://").ok_or("the gateway is https://HOST:PORT")?;
        let authority = rest.trim_end_matches('/');
        if authority.contains('/') || authority.contains('@') {
            return Err("the gateway is https://HOST:PORT, without a path or user".into());
        }
        let (host, port) = authority.rsplit_once(':').ok_or("the gateway URL names no port")?;
        let port: u16 = port.parse().map_err(|_| "the gateway's port is not a number".to_owned())?;
        let host = host.trim_start_matches('[').trim_end_matches(']').to_owned();
        match scheme {
            "https" => {
                let pin = pin.ok_or("an https gateway needs serving_ca_spki_pin (or --serving-ca-pin)")?;
                check_pin(pin)?;
                Ok(Self { host, port, pin: Some(pin.to_owned()) })
            }
            "http" => {
                let loopback = host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
                if !loopback {
                    return Err(format!(
                        "bcd refuses plaintext (http://) to {host}: only a loopback dev gateway may be plaintext"
                    ));
                }
                Ok(Self { host, port, pin: None })
            }
            other => Err(format!("the gateway's scheme is https, not {other:?}")),
        }
    }

    /// A channel that connects lazily, through the pinned TLS connector or h2c.
    pub fn channel(&self) -> Result<Channel, String> {
        self.channel_presenting(None, Arc::new(AtomicBool::new(false)))
    }

    /// [`Gateway::channel`], presenting `certificates`' current node certificate in each TLS
    /// handshake; `revoked` is set when the gateway's TLS layer refuses it as revoked.
    pub fn channel_presenting(
        &self,
        certificates: Option<Arc<dyn ResolvesClientCert>>,
        revoked: Arc<AtomicBool>,
    ) -> Result<Channel, String> {
        let endpoint = Endpoint::from_shared(format!("http://{}:{}", bracket(&self.host), self.port))
            .map_err(|e| format!("the gateway address: {e}"))?
            .connect_timeout(Duration::from_millis(CONNECT_TIMEOUT_MS))
            // Room in the connection's window for every stream's (`bc_proto`'s windows): a
            // tunnel whose guest reads nothing never holds back the session or another tunnel.
            .initial_stream_window_size(bc_proto::AGENT_STREAM_WINDOW_BYTES)
            .initial_connection_window_size(bc_proto::AGENT_CONNECTION_WINDOW_BYTES)
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(10))
            .keep_alive_while_idle(true);
        let Some(pin) = self.pin.clone() else {
            return Ok(endpoint.connect_lazy());
        };
        let config = client_config(pin, certificates)?;
        let (host, port) = (self.host.clone(), self.port);
        let connector = tower::service_fn(move |_: tonic::transport::Uri| {
            let (config, host, revoked) = (config.clone(), host.clone(), revoked.clone());
            async move {
                let tls = connect_tls(config, &host, port).await?;
                Ok::<_, std::io::Error>(TokioIo::new(AlertWatch { inner: tls, revoked }))
            }
        });
        Ok(endpoint.connect_with_connector_lazy(connector))
    }

    /// One TLS handshake through the same connector [`Gateway::channel`] uses, to say whether
    /// the gateway answers and whether its key matches the pin (`bcd doctor`). `Ok(false)`:
    /// plaintext h2c, nothing to pin.
    pub async fn handshake(&self) -> Result<bool, HandshakeError> {
        let Some(pin) = self.pin.clone() else {
            let connect = tokio::net::TcpStream::connect((self.host.as_str(), self.port));
            tokio::time::timeout(Duration::from_millis(CONNECT_TIMEOUT_MS), connect)
                .await
                .map_err(|_| HandshakeError::Unreachable("connecting timed out".into()))?
                .map_err(|e| HandshakeError::Unreachable(e.to_string()))?;
            return Ok(false);
        };
        let config = client_config(pin, None).map_err(HandshakeError::Tls)?;
        let handshake = connect_tls(config, &self.host, self.port);
        match tokio::time::timeout(Duration::from_millis(CONNECT_TIMEOUT_MS), handshake).await {
            Err(_) => Err(HandshakeError::Unreachable("connecting timed out".into())),
            Ok(Ok(_)) => Ok(true),
            Ok(Err(e)) => {
                let pin_mismatch =
                    e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()).is_some_and(bc_pin::is_pin_mismatch);
                Err(if pin_mismatch {
                    HandshakeError::PinMismatch
                } else if e.get_ref().is_some_and(|inner| inner.is::<rustls::Error>()) {
                    HandshakeError::Tls(e.to_string())
                } else {
                    HandshakeError::Unreachable(e.to_string())
                })
            }
        }
    }
}

/// A TLS stream that notes the gateway's `certificate_revoked` alert. Under TLS 1.3 the server
/// judges the client's certificate after the client's side of the handshake is done, so its
/// refusal arrives on the first read, inside HTTP/2, which reports only "connection closed":
/// this is where the alert is still a `rustls::Error`.
struct AlertWatch<T> {
    inner: T,
    revoked: Arc<AtomicBool>,
}

impl<T: AsyncRead + Unpin> AsyncRead for AlertWatch<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Err(e)) = &polled
            && matches!(
                e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()),
                Some(rustls::Error::AlertReceived(rustls::AlertDescription::CertificateRevoked))
            )
        {
            self.revoked.store(true, Ordering::SeqCst);
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for AlertWatch<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Why [`Gateway::handshake`] failed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("the gateway does not answer: {0}")]
    Unreachable(String),
    #[error("the gateway's certificate key does not match serving_ca_spki_pin")]
    PinMismatch,
    #[error("the TLS handshake failed: {0}")]
    Tls(String),
}

/// TCP, then TLS with the pin verifier: the one way bcd reaches a TLS gateway.
async fn connect_tls(
    config: Arc<rustls::ClientConfig>,
    host: &str,
    port: u16,
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let tcp = tokio::net::TcpStream::connect((host, port)).await?;
    tcp.set_nodelay(true)?;
    let name = match host.parse::<IpAddr>() {
        Ok(ip) => ServerName::IpAddress(ip.into()),
        Err(_) => ServerName::try_from(host.to_owned()).map_err(|e| std::io::Error::other(e.to_string()))?,
    };
    tokio_rustls::TlsConnector::from(config).connect(name, tcp).await
}

fn bracket(host: &str) -> String {
    if host.contains(':') { format!("[{host}]") } else { host.to_owned() }
}

/// A pin is `sha256/` + the standard base64 of 32 bytes.
pub fn check_pin(pin: &str) -> Result<(), String> {
    bc_pin::check_pin(pin).map_err(|e| e.to_string())
}

fn client_config(pin: String, certificates: Option<Arc<dyn ResolvesClientCert>>) -> Result<Arc<rustls::ClientConfig>, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(
            bc_pin::Verifier::pinned(&pin, "the gateway's certificate", provider).map_err(|e| e.to_string())?,
        ));
    let mut config = match certificates {
        Some(resolver) => config.with_client_cert_resolver(resolver),
        None => config.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use base64::Engine;

    use super::*;

    #[test]
    fn plaintext_only_to_loopback_and_tls_only_with_a_pin() {
        let pin = format!("sha256/{}", base64::engine::general_purpose::STANDARD.encode([0u8; 32]));
        assert!(Gateway::parse("http://127.0.0.1:7444", None).is_ok());
        assert!(Gateway::parse("http://[::1]:7444", None).is_ok());
        assert!(Gateway::parse("http://10.0.0.5:7444", None).unwrap_err().contains("refuses plaintext"));
        assert!(Gateway::parse("http://gw.example:7444", None).is_err());
        assert!(Gateway::parse("https://gw.example:7444", None).is_err());
        assert!(Gateway::parse("https://gw.example:7444", Some("sha256/short")).is_err());
        let g = Gateway::parse("https://gw.example:7444", Some(&pin)).unwrap();
        assert_eq!((g.host.as_str(), g.port), ("gw.example", 7444));
    }
}
