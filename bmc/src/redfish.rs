//! The Redfish client: [`RedfishBmc`] speaks DMTF Redfish to one BMC over HTTPS
//! with HTTP basic authentication, every request bounded by [`crate::REQUEST_TIMEOUT_S`]
//! (connecting included) and every answer by [`RESPONSE_BYTES_MAX`].
//!
//! Layout: the client and its requests first; then the certificate checks ([`BmcTls`] as a
//! rustls `ClientConfig`: a CA bundle and nothing else, a pin of the leaf's key, or nothing);
//! then the pure mapping from Redfish JSON to [`SystemInfo`], action targets and collection
//! members, which the unit tests below hold to their shapes.
//!
//! What it reads it finds by following links, never by guessing paths: the system is the
//! target's `system_path` or the only member of `/redfish/v1/Systems`; the reset target is
//! the system's `Actions.#ComputerSystem.Reset.target`; the virtual CD is the member of the
//! system's manager's (`Links.ManagedBy`) `VirtualMedia` collection whose `MediaTypes` holds
//! `CD` or `DVD`. The paths found are kept for the client's life. Every link is checked to stay
//! on the BMC's own origin, so the credentials go nowhere else.
//!
//! Where it connects: only to addresses the deployment's [`BmcNetworks`] admit, an address
//! literal checked when the client is made (one per step) and every address a name resolves to
//! checked by the client's resolver, at connect time.
//!
//! What its errors say (they end up in `workflow.lastError`, which the tenant reads): the
//! request (`GET /redfish/v1/Systems`), the HTTP status and the Redfish error's messages, never
//! an answer's raw body, a redirect's target or the transport's cause: every failure to get a
//! TLS session (refused, timed out, not TLS, the certificate) reads the same, so an error does
//! not tell an open port from a closed one. The cause is in the log, for the operator.
//!
//! The password is sent in the `Authorization` header only; no error, log line or `Debug`
//! output is built from it (errors are made of the request's method and path, the status and
//! the BMC's own message), so none needs scrubbing.

use std::sync::Arc;
use std::time::Duration;

use reqwest::{Method, StatusCode};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use serde_json::{Value, json};
use tokio::sync::OnceCell;

use crate::network::{BmcNetworks, address_refused};
use crate::{
    Bmc, BmcError, BmcResult, BmcTarget, BmcTls, BootSource, CONNECT_TIMEOUT_S, PowerState, REQUEST_TIMEOUT_S, ResetType,
    SystemInfo,
};

/// The largest answer read from a BMC; a longer one is refused as a protocol error (a
/// ComputerSystem is a few KiB).
pub const RESPONSE_BYTES_MAX: usize = 1 << 20;

/// The longest BMC error message kept in a [`BmcError`] (which may end up in an event).
pub const MESSAGE_CHARS_MAX: usize = 512;

/// The most virtual media members looked at for the CD drive (each is one GET).
pub const MEDIA_MEMBERS_MAX: usize = 16;

/// The most managers (`Links.ManagedBy`) looked at for a virtual media collection.
pub const MANAGERS_MAX: usize = 4;

/// The service's systems collection, where the system is found when the target names none.
const SYSTEMS_PATH: &str = "/redfish/v1/Systems";

/// A Redfish client for one BMC. Cheap to keep: it holds a connection-less HTTP client and
/// the paths it found.
pub struct RedfishBmc {
    http: reqwest::Client,
    /// `https://host[:port]`: every request goes here and nowhere else.
    origin: url::Url,
    username: String,
    password: String,
    /// The target's own system path, if it named one.
    system_path_given: Option<String>,
    /// Per request, connecting included: [`REQUEST_TIMEOUT_S`] unless a test shortened it.
    timeout: Duration,
    /// The ComputerSystem's path, found once.
    system_path: OnceCell<String>,
    /// The system's `#ComputerSystem.Reset` target, read once from the system.
    reset_target: OnceCell<String>,
    /// The virtual CD drive's path, found once; `None`: the BMC has none.
    media_path: OnceCell<Option<String>>,
}

impl std::fmt::Debug for RedfishBmc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedfishBmc")
            .field("origin", &self.origin.as_str())
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .field("system_path", &self.system_path.get().or(self.system_path_given.as_ref()))
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// One answer, read to its end (at most [`RESPONSE_BYTES_MAX`]).
struct Answer {
    etag: Option<String>,
    body: Vec<u8>,
}

impl RedfishBmc {
    /// A client for `target`: checks the address (`https://host[:port]`, nothing else; an
    /// address literal inside `networks`) and builds the TLS configuration its [`BmcTls`] asks
    /// for. Sends nothing yet; a host name is resolved, and its addresses checked against
    /// `networks`, when a request connects.
    pub fn new(target: &BmcTarget, networks: &BmcNetworks) -> BmcResult<Self> {
        let origin = origin_of(&target.address)?;
        if let Some(host) = origin.host() {
            networks.check_literal(&host)?;
        }
        if let Some(path) = &target.system_path
            && (!path.starts_with('/') || path.starts_with("//"))
        {
            return Err(BmcError::Protocol(format!(
                "the system path {path:?} is not a path on the BMC (it is /redfish/v1/Systems/<id>)"
            )));
        }
        // Once per BMC per process: a client is made for every step and every power sync, and
        // a warning each time would bury everything else in the log.
        static WARNED_INSECURE: std::sync::Mutex<std::collections::BTreeSet<String>> =
            std::sync::Mutex::new(std::collections::BTreeSet::new());
        if matches!(target.tls, BmcTls::Insecure)
            && WARNED_INSECURE.lock().unwrap_or_else(|p| p.into_inner()).insert(origin.to_string())
        {
            tracing::warn!(
                bmc = %origin,
                "the BMC's TLS certificate is not checked (insecure mode): whoever is on the path can read its credentials"
            );
        }
        let tls = client_config(&target.tls)?;
        let http = reqwest::Client::builder()
            .tls_backend_preconfigured(tls)
            .https_only(true)
            .http1_only()
            .connect_timeout(Duration::from_secs(CONNECT_TIMEOUT_S))
            .dns_resolver(Arc::new(NetworksResolver { networks: networks.clone() }))
            .timeout(Duration::from_secs(REQUEST_TIMEOUT_S))
            .redirect(reqwest::redirect::Policy::none())
            // A BMC is reached directly on its management network; a proxy from the
            // environment would see its credentials.
            .no_proxy()
            // No idle connections kept: BMCs' embedded servers close kept-alive connections
            // early and unannounced, and a POST sent on one being closed is lost (not
            // retried). One handshake per call is nothing at a reconciler's pace.
            .pool_max_idle_per_host(0)
            .user_agent(concat!("better-compute-bmc/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| BmcError::Protocol(format!("building the HTTP client: {}", chain(&e))))?;
        Ok(RedfishBmc {
            http,
            origin,
            username: target.username.clone(),
            password: target.password.clone(),
            system_path_given: target.system_path.clone(),
            timeout: Duration::from_secs(REQUEST_TIMEOUT_S),
            system_path: OnceCell::new(),
            reset_target: OnceCell::new(),
            media_path: OnceCell::new(),
        })
    }

    /// The same client with every request bounded by `timeout` instead of
    /// [`REQUEST_TIMEOUT_S`] (which stays the upper bound of connecting): for tests that prove
    /// a silent BMC times out, without waiting 30 s.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.min(Duration::from_secs(REQUEST_TIMEOUT_S));
        self
    }

    /// The ComputerSystem's path: the target's, or the only member of the systems collection.
    pub async fn system_path(&self) -> BmcResult<&str> {
        let path = self
            .system_path
            .get_or_try_init(|| async {
                if let Some(path) = &self.system_path_given {
                    return Ok(path.clone());
                }
                let (systems, _) = self.get_json(SYSTEMS_PATH).await?;
                only_member(&systems, SYSTEMS_PATH)
            })
            .await?;
        Ok(path)
    }

    /// The ComputerSystem resource and its ETag (header, else `@odata.etag`).
    async fn system_resource(&self) -> BmcResult<(Value, Option<String>)> {
        let path = self.system_path().await?.to_owned();
        let (system, etag) = self.get_json(&path).await?;
        let etag = etag.or_else(|| system.get("@odata.etag").and_then(Value::as_str).map(str::to_owned));
        Ok((system, etag))
    }

    /// The virtual CD drive's path, found from `system` the first time.
    async fn media_path(&self, system: &Value) -> BmcResult<Option<String>> {
        let path = self.media_path.get_or_try_init(|| self.find_media(system)).await?;
        Ok(path.clone())
    }

    /// The member of the manager's `VirtualMedia` collection (the system's own, when no manager
    /// links one) whose `MediaTypes` holds `CD` or `DVD`.
    async fn find_media(&self, system: &Value) -> BmcResult<Option<String>> {
        let mut collections = Vec::new();
        for manager in links_managed_by(system).into_iter().take(MANAGERS_MAX) {
            let (manager, _) = self.get_json(&manager).await?;
            if let Some(path) = manager.get("VirtualMedia").and_then(odata_id) {
                collections.push(path.to_owned());
            }
        }
        if collections.is_empty()
            && let Some(path) = system.get("VirtualMedia").and_then(odata_id)
        {
            collections.push(path.to_owned());
        }
        for collection in collections {
            let (members, _) = self.get_json(&collection).await?;
            for member in members_of(&members).into_iter().take(MEDIA_MEMBERS_MAX) {
                let (media, _) = self.get_json(&member).await?;
                if is_cd_drive(&media) {
                    tracing::debug!(bmc = %self.origin, media = %member, "found the virtual CD drive");
                    return Ok(Some(member));
                }
            }
        }
        Ok(None)
    }

    /// The virtual CD drive's path, reading the system first if it was not found yet.
    async fn media_path_found(&self) -> BmcResult<Option<String>> {
        match self.media_path.get() {
            Some(path) => Ok(path.clone()),
            None => {
                let (system, _) = self.system_resource().await?;
                self.media_path(&system).await
            }
        }
    }

    /// The virtual CD drive's path, or a protocol error saying the BMC has none.
    async fn media_path_required(&self) -> BmcResult<String> {
        self.media_path_found().await?.ok_or_else(|| {
            BmcError::Protocol("the BMC has no virtual CD or DVD drive (no VirtualMedia member with MediaTypes CD or DVD)".into())
        })
    }

    /// Ejects what the drive (its resource `media`, as just read) holds, if anything.
    async fn eject(&self, media: &Value) -> BmcResult<()> {
        if is_inserted(media) {
            let target = action_target(media, "#VirtualMedia.EjectMedia")?;
            self.send(Method::POST, &target, Some(&json!({})), None).await?;
        }
        Ok(())
    }

    async fn get_json(&self, path: &str) -> BmcResult<(Value, Option<String>)> {
        let answer = self.send(Method::GET, path, None, None).await?;
        let value = serde_json::from_slice(&answer.body)
            .map_err(|e| BmcError::Protocol(format!("GET {path}: the answer is not JSON ({e})")))?;
        Ok((value, answer.etag))
    }

    /// One request: `Accept: application/json`, `OData-Version: 4.0`, basic auth, the
    /// client's timeout; an answer that is not 2xx becomes its [`BmcError`].
    async fn send(&self, method: Method, path: &str, body: Option<&Value>, if_match: Option<&str>) -> BmcResult<Answer> {
        let url = self.url_of(path)?;
        let mut request = self
            .http
            .request(method.clone(), url)
            .timeout(self.timeout)
            .basic_auth(&self.username, Some(&self.password))
            .header(reqwest::header::ACCEPT, "application/json")
            .header("OData-Version", "4.0");
        if let Some(body) = body {
            request = request.json(body);
        }
        if let Some(etag) = if_match {
            request = request.header(reqwest::header::IF_MATCH, etag);
        }
        let what = format!("{method} {path}");
        let mut response = request.send().await.map_err(|e| self.transport_error(&what, &e))?;
        let status = response.status();
        let etag = response.headers().get(reqwest::header::ETAG).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let location = response.headers().get(reqwest::header::LOCATION).and_then(|v| v.to_str().ok()).map(str::to_owned);
        if response.content_length().is_some_and(|n| n > RESPONSE_BYTES_MAX as u64) {
            return Err(BmcError::Protocol(format!("{what}: the answer is larger than {RESPONSE_BYTES_MAX} bytes")));
        }
        let mut bytes = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| self.transport_error(&what, &e))? {
            if bytes.len() + chunk.len() > RESPONSE_BYTES_MAX {
                return Err(BmcError::Protocol(format!("{what}: the answer is larger than {RESPONSE_BYTES_MAX} bytes")));
            }
            bytes.extend_from_slice(&chunk);
        }
        tracing::debug!(bmc = %self.origin, request = %what, status = status.as_u16(), "redfish");
        if status.is_success() {
            return Ok(Answer { etag, body: bytes });
        }
        let mut message = error_message(&bytes).unwrap_or_else(|| status.canonical_reason().unwrap_or("no message").to_owned());
        if status.is_redirection() {
            // Where it points stays in the log: the tenant learns of a redirect, not its target.
            tracing::info!(bmc = %self.origin, request = %what, location = ?location, "the BMC answered a redirect");
            message = "a redirect; the client follows none (is the address the BMC's own?)".to_owned();
        }
        let message = format!("{what}: {message}");
        Err(match status {
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                BmcError::Unauthorized(format!("HTTP {} for {message}", status.as_u16()))
            }
            _ => BmcError::Refused { status: status.as_u16(), message },
        })
    }

    /// `path` on the BMC's origin; a link to anywhere else is refused.
    fn url_of(&self, path: &str) -> BmcResult<url::Url> {
        let url =
            self.origin.join(path).map_err(|e| BmcError::Protocol(format!("the link {path:?} is not a path on the BMC: {e}")))?;
        if url.origin() != self.origin.origin() {
            return Err(BmcError::Protocol(format!(
                "the link {path:?} points away from the BMC ({}); refused, so the credentials go nowhere else",
                self.origin
            )));
        }
        Ok(url)
    }

    /// What a failed exchange tells the caller: one text for every failure to get a TLS
    /// session, whatever its cause (which goes to the log), so the text does not tell a closed
    /// port, a silent one, one that is not TLS and one with another certificate apart.
    fn transport_error(&self, what: &str, e: &reqwest::Error) -> BmcError {
        let refused = error_sources(e).any(|s| s.is::<AddressRefused>());
        tracing::info!(bmc = %self.origin, request = %what, error = %chain(e), "a BMC request failed");
        if refused {
            return address_refused();
        }
        if e.is_connect() {
            BmcError::Unreachable(format!("{what}: {NO_SESSION}"))
        } else if e.is_timeout() {
            BmcError::Timeout(format!("{what}: no answer within {} ms", self.timeout.as_millis()))
        } else {
            BmcError::Unreachable(format!("{what}: the connection to the BMC ended before its answer"))
        }
    }
}

#[async_trait::async_trait]
impl Bmc for RedfishBmc {
    async fn system(&self) -> BmcResult<SystemInfo> {
        let (system, _) = self.system_resource().await?;
        let media = match self.media_path(&system).await? {
            Some(path) => Some(self.get_json(&path).await?.0),
            None => None,
        };
        Ok(system_info(&system, media.as_ref()))
    }

    async fn reset(&self, reset: ResetType) -> BmcResult<()> {
        let target = self
            .reset_target
            .get_or_try_init(|| async {
                let (system, _) = self.system_resource().await?;
                action_target(&system, "#ComputerSystem.Reset")
            })
            .await?
            .clone();
        self.send(Method::POST, &target, Some(&json!({ "ResetType": reset.as_str() })), None).await?;
        Ok(())
    }

    async fn set_boot_once(&self, source: BootSource) -> BmcResult<()> {
        let (_, etag) = self.system_resource().await?;
        let path = self.system_path().await?.to_owned();
        let body = json!({ "Boot": { "BootSourceOverrideEnabled": "Once", "BootSourceOverrideTarget": source.as_str() } });
        self.send(Method::PATCH, &path, Some(&body), etag.as_deref()).await?;
        Ok(())
    }

    async fn insert_media(&self, image_url: &str) -> BmcResult<()> {
        let media_path = self.media_path_required().await?;
        let (media, _) = self.get_json(&media_path).await?;
        let target = action_target(&media, "#VirtualMedia.InsertMedia")?;
        self.eject(&media).await?;
        let body = json!({ "Image": image_url, "Inserted": true, "WriteProtected": true });
        self.send(Method::POST, &target, Some(&body), None).await?;
        Ok(())
    }

    async fn eject_media(&self) -> BmcResult<()> {
        // No drive at all holds no media either: nothing to eject is what was asked.
        match self.media_path_found().await? {
            Some(path) => self.eject(&self.get_json(&path).await?.0).await,
            None => Ok(()),
        }
    }
}

/// The one text of every failure to get a TLS session with a BMC.
pub const NO_SESSION: &str = "no TLS session with the BMC (the connection was refused or timed out, the port does not \
speak TLS, or the certificate did not verify); hint: a BMC whose certificate is self-signed (its own CA) is trusted by its \
key with --bmc-pin sha256/… (the log of the process that ran the step names the cause and the key the BMC presents)";

/// Resolves a BMC's host name, keeping only the addresses the BMC networks admit.
struct NetworksResolver {
    networks: BmcNetworks,
}

impl reqwest::dns::Resolve for NetworksResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let networks = self.networks.clone();
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let addrs: Vec<std::net::SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let admitted: Vec<std::net::SocketAddr> = addrs.iter().copied().filter(|a| networks.admits(a.ip()).is_ok()).collect();
            if admitted.is_empty() {
                // Which addresses stays in the operator's log: the tenant learns only that
                // the name was refused.
                tracing::warn!(host = %host, addresses = ?addrs, "a BMC's name resolves only to addresses outside the BMC networks");
                return Err(Box::new(AddressRefused) as Box<dyn std::error::Error + Send + Sync>);
            }
            Ok(Box::new(admitted.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

#[derive(Debug, thiserror::Error)]
#[error("the BMC's name resolves only to addresses outside the BMC networks")]
struct AddressRefused;

fn error_sources<'a>(e: &'a (dyn std::error::Error + 'static)) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    std::iter::successors(Some(e), |e| e.source())
}

/// `https://host[:port]` from the target's address: no other scheme, no credentials, no path.
fn origin_of(address: &url::Url) -> BmcResult<url::Url> {
    if address.scheme() != "https" {
        return Err(BmcError::Protocol(format!(
            "the BMC address must be https:// (it is {}://): the client sends credentials, so it speaks only TLS",
            address.scheme()
        )));
    }
    if address.host_str().is_none_or(str::is_empty) {
        return Err(BmcError::Protocol("the BMC address names no host".into()));
    }
    if !address.username().is_empty() || address.password().is_some() {
        return Err(BmcError::Protocol(
            "the BMC address carries credentials: give them as the target's username and password instead".into(),
        ));
    }
    if !matches!(address.path(), "" | "/") || address.query().is_some() || address.fragment().is_some() {
        return Err(BmcError::Protocol(format!(
            "the BMC address is the service's origin only (https://host[:port]), not {}",
            address.as_str()
        )));
    }
    let mut origin = address.clone();
    origin.set_path("/");
    Ok(origin)
}

/// An error and its sources, one line: reqwest's own text hides the TLS or IO cause.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = String::new();
    let mut next = Some(e);
    while let Some(cause) = next {
        let cause_text = describe(cause);
        if !text.contains(&cause_text) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&cause_text);
        }
        next = cause.source();
    }
    text
}

/// One error's text; a verifier's own error (the pin's) by its Display, where rustls shows it
/// by its Debug form. rustls's error arrives inside `io::Error`s, whose `source` skips it.
fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    let mut inner = e;
    while let Some(wrapped) = inner.downcast_ref::<std::io::Error>().and_then(|io| io.get_ref()) {
        inner = wrapped;
    }
    match inner.downcast_ref::<rustls::Error>() {
        Some(rustls::Error::InvalidCertificate(rustls::CertificateError::Other(other))) => {
            format!("invalid peer certificate: {}", other.0)
        }
        _ => e.to_string(),
    }
}

// --- Certificate checks ---------------------------------------------------------------------

/// The rustls configuration for `tls`, on the `ring` provider, offering HTTP/1.1 only.
fn client_config(tls: &BmcTls) -> BmcResult<rustls::ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| BmcError::Protocol(format!("the TLS configuration: {e}")))?;
    let mut config = match tls {
        BmcTls::CaBundle { pem } => {
            let inner = rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(ca_roots(pem)?), provider.clone())
                .build()
                .map_err(|e| BmcError::Protocol(format!("the BMC's CA bundle: {e}")))?;
            builder.dangerous().with_custom_certificate_verifier(Arc::new(ca_verifier(inner, provider))).with_no_client_auth()
        }
        BmcTls::Pin { pin } => {
            builder.dangerous().with_custom_certificate_verifier(Arc::new(pin_verifier(pin, provider)?)).with_no_client_auth()
        }
        BmcTls::Insecure => {
            builder.dangerous().with_custom_certificate_verifier(Arc::new(bc_pin::Verifier::any(provider))).with_no_client_auth()
        }
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// The CA bundle's certificates as the only trust anchors (the system's roots are not used).
fn ca_roots(pem: &str) -> BmcResult<rustls::RootCertStore> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
        let cert = cert.map_err(|e| BmcError::Protocol(format!("the BMC's CA bundle is not PEM: {e}")))?;
        roots.add(cert).map_err(|e| BmcError::Protocol(format!("a certificate of the BMC's CA bundle: {e}")))?;
    }
    if roots.is_empty() {
        return Err(BmcError::Protocol("the BMC's CA bundle holds no certificate".into()));
    }
    Ok(roots)
}

/// The CA bundle's check (webpki's, the host name included), whose refusal says what to do: a
/// BMC's self-signed certificate (its own CA, webpki's bare `CaUsedAsEndEntity`) is trusted by
/// pinning its key, and the refusal names the key it presented.
fn ca_verifier(inner: Arc<rustls::client::WebPkiServerVerifier>, provider: Arc<CryptoProvider>) -> bc_pin::Verifier {
    bc_pin::Verifier::ca(inner, |cause, presented| Arc::new(NotByTheCa { cause, presented }), provider)
}

/// The certificate did not verify against the CA bundle.
#[derive(Debug, thiserror::Error)]
#[error(
    "{cause}: the BMC's certificate does not verify against its CA bundle; if it is self-signed (its own CA), trust it by its key instead: --bmc-pin {presented}"
)]
struct NotByTheCa {
    cause: String,
    presented: String,
}

/// The pin of a certificate's key (`bc_pin::spki_pin`, RFC 7469's `sha256/` + base64).
pub use bc_pin::spki_pin;

/// Accepts exactly the leaf whose key hashes to `pin` (`bc_pin::Verifier::pinned`), whatever signed it
/// and whatever name or dates it carries: a BMC's self-signed certificate rarely names its address
/// or is renewed. A mismatch names the key the BMC presented.
fn pin_verifier(pin: &str, provider: Arc<CryptoProvider>) -> BmcResult<bc_pin::Verifier> {
    bc_pin::Verifier::pinned(pin, "the BMC's certificate", provider)
        .map_err(|e| BmcError::Protocol(format!("the BMC's certificate pin: {e}")))
}

// --- Redfish JSON, read ---------------------------------------------------------------------

/// A resource link's `@odata.id`.
fn odata_id(link: &Value) -> Option<&str> {
    link.get("@odata.id").and_then(Value::as_str)
}

/// A collection's member paths, in order.
fn members_of(collection: &Value) -> Vec<String> {
    collection
        .get("Members")
        .and_then(Value::as_array)
        .map(|members| members.iter().filter_map(odata_id).map(str::to_owned).collect())
        .unwrap_or_default()
}

/// The only member of `collection` (at `path`); none or several is a protocol error naming them.
fn only_member(collection: &Value, path: &str) -> BmcResult<String> {
    let mut members = members_of(collection);
    match members.len() {
        1 => Ok(members.remove(0)),
        0 => Err(BmcError::Protocol(format!("{path} lists no system"))),
        n => Err(BmcError::Protocol(format!(
            "{path} lists {n} systems ({}): name one as the target's system path",
            members.join(", ")
        ))),
    }
}

/// The managers of a system (`Links.ManagedBy`).
fn links_managed_by(system: &Value) -> Vec<String> {
    system
        .pointer("/Links/ManagedBy")
        .and_then(Value::as_array)
        .map(|links| links.iter().filter_map(odata_id).map(str::to_owned).collect())
        .unwrap_or_default()
}

/// The target of the action `name` (`#ComputerSystem.Reset`) of `resource`.
fn action_target(resource: &Value, name: &str) -> BmcResult<String> {
    resource
        .get("Actions")
        .and_then(|actions| actions.get(name))
        .and_then(|action| action.get("target"))
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| {
            let at = odata_id(resource).unwrap_or("the resource");
            BmcError::Protocol(format!("{at} offers no {name} action (no Actions.{name}.target)"))
        })
}

/// Whether a VirtualMedia resource is a CD or DVD drive.
fn is_cd_drive(media: &Value) -> bool {
    media
        .get("MediaTypes")
        .and_then(Value::as_array)
        .is_some_and(|types| types.iter().filter_map(Value::as_str).any(|t| t == "CD" || t == "DVD"))
}

/// The image a VirtualMedia resource holds: `Image`, unless empty or `Inserted` is false.
fn media_image(media: &Value) -> Option<String> {
    if media.get("Inserted").and_then(Value::as_bool) == Some(false) {
        return None;
    }
    text(media, "Image")
}

/// Whether a drive holds something to eject.
fn is_inserted(media: &Value) -> bool {
    media.get("Inserted").and_then(Value::as_bool).unwrap_or(false) || media_image(media).is_some()
}

/// A non-empty string field (BMCs fill unknown fields with `""`).
fn text(resource: &Value, field: &str) -> Option<String> {
    resource.get(field).and_then(Value::as_str).map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned)
}

fn power_state(name: &str) -> Option<PowerState> {
    match name {
        "On" => Some(PowerState::On),
        "Off" => Some(PowerState::Off),
        "PoweringOn" => Some(PowerState::PoweringOn),
        "PoweringOff" => Some(PowerState::PoweringOff),
        _ => None,
    }
}

fn boot_source(name: &str) -> Option<BootSource> {
    match name {
        "Pxe" => Some(BootSource::Pxe),
        "Cd" => Some(BootSource::Cd),
        "Hdd" => Some(BootSource::Hdd),
        _ => None,
    }
}

/// The pending one-time override: a target only when `BootSourceOverrideEnabled` is `Once`
/// (a `Continuous` one is a setting, not a pending boot; a target this project never sets is
/// not reported as one it does).
fn boot_once(system: &Value) -> Option<BootSource> {
    let boot = system.get("Boot")?;
    if boot.get("BootSourceOverrideEnabled").and_then(Value::as_str) != Some("Once") {
        return None;
    }
    boot_source(boot.get("BootSourceOverrideTarget").and_then(Value::as_str)?)
}

/// What a ComputerSystem (and its virtual CD drive's resource, if it has one) says.
fn system_info(system: &Value, media: Option<&Value>) -> SystemInfo {
    let memory_gib = system
        .pointer("/MemorySummary/TotalSystemMemoryGiB")
        .and_then(Value::as_f64)
        .and_then(|gib| (gib.is_finite() && gib >= 0.0 && gib <= f64::from(u32::MAX)).then(|| gib.round() as u32));
    SystemInfo {
        power_state: system.get("PowerState").and_then(Value::as_str).and_then(power_state),
        manufacturer: text(system, "Manufacturer"),
        model: text(system, "Model"),
        serial_number: text(system, "SerialNumber"),
        uuid: text(system, "UUID"),
        processor_count: system.pointer("/ProcessorSummary/Count").and_then(Value::as_u64).and_then(|n| u32::try_from(n).ok()),
        memory_gib,
        boot_once: boot_once(system),
        media_image: media.and_then(media_image),
    }
}

// --- Redfish JSON, errors -------------------------------------------------------------------

/// What a BMC's error answer says: `error.message` and the `@Message.ExtendedInfo` messages
/// (where iDRAC and iLO put the specific reason), cut to [`MESSAGE_CHARS_MAX`]; nothing from
/// an answer that is not a Redfish error (its raw body never reaches an error: whatever
/// answered may not be a BMC).
fn error_message(body: &[u8]) -> Option<String> {
    let message = match serde_json::from_slice::<Value>(body) {
        Ok(value) => {
            let error = value.get("error")?;
            let own = error.get("message").and_then(Value::as_str);
            let extended = error.get("@Message.ExtendedInfo").and_then(Value::as_array).into_iter().flatten();
            let parts: Vec<&str> = own
                .into_iter()
                .chain(extended.filter_map(|info| info.get("Message").and_then(Value::as_str)))
                .map(str::trim)
                .filter(|m| !m.is_empty())
                .collect();
            if parts.is_empty() {
                return None;
            }
            parts.join("; ")
        }
        Err(_) => return None,
    };
    Some(cut(&message))
}

fn cut(text: &str) -> String {
    if text.chars().count() <= MESSAGE_CHARS_MAX {
        return text.to_owned();
    }
    let mut cut: String = text.chars().take(MESSAGE_CHARS_MAX).collect();
    cut.push('…');
    cut
}

#[cfg(test)]
mod tests {
    use base64::Engine;
    use rustls::client::danger::ServerCertVerifier;
    use rustls::pki_types::{ServerName, UnixTime};
    use sha2::{Digest, Sha256};

    use super::*;

    /// A management network of 10/8, as an operator names it.
    fn lab() -> BmcNetworks {
        BmcNetworks::parse(&["10.0.0.0/8", "fd00::/8"]).unwrap()
    }

    fn target(address: &str, tls: BmcTls) -> BmcTarget {
        BmcTarget {
            address: url::Url::parse(address).unwrap(),
            system_path: None,
            username: "admin".into(),
            password: "hunter2-secret".into(),
            tls,
        }
    }

    /// A ComputerSystem as a Dell iDRAC 9 answers it (abridged), with a one-time PXE boot set.
    fn idrac_system() -> Value {
        json!({
            "@odata.id": "/redfish/v1/Systems/System.Embedded.1",
            "Id": "System.Embedded.1",
            "Manufacturer": "Dell Inc.",
            "Model": "PowerEdge R750",
            "SerialNumber": "CN7475123A0042",
            "UUID": "4c4c4544-0042-3510-8052-b4c04f4d3933",
            "PowerState": "On",
            "ProcessorSummary": { "Count": 2, "Model": "Intel(R) Xeon(R) Gold 6338" },
            "MemorySummary": { "TotalSystemMemoryGiB": 511.75 },
            "Boot": {
                "BootSourceOverrideEnabled": "Once",
                "BootSourceOverrideTarget": "Pxe",
                "BootSourceOverrideTarget@Redfish.AllowableValues": ["None", "Pxe", "Cd", "Hdd", "BiosSetup"]
            },
            "Links": { "ManagedBy": [{ "@odata.id": "/redfish/v1/Managers/iDRAC.Embedded.1" }] },
            "Actions": {
                "#ComputerSystem.Reset": {
                    "target": "/redfish/v1/Systems/System.Embedded.1/Actions/ComputerSystem.Reset",
                    "ResetType@Redfish.AllowableValues": ["On", "ForceOff", "ForceRestart", "GracefulShutdown"]
                }
            }
        })
    }

    #[test]
    fn a_computer_system_maps_field_by_field() {
        let media = json!({ "Image": "http://10.0.0.1/boot.iso", "Inserted": true, "MediaTypes": ["CD", "DVD"] });
        let info = system_info(&idrac_system(), Some(&media));
        assert_eq!(
            info,
            SystemInfo {
                power_state: Some(PowerState::On),
                manufacturer: Some("Dell Inc.".into()),
                model: Some("PowerEdge R750".into()),
                serial_number: Some("CN7475123A0042".into()),
                uuid: Some("4c4c4544-0042-3510-8052-b4c04f4d3933".into()),
                processor_count: Some(2),
                memory_gib: Some(512),
                boot_once: Some(BootSource::Pxe),
                media_image: Some("http://10.0.0.1/boot.iso".into()),
            }
        );
    }

    #[test]
    fn absent_empty_and_unknown_fields_are_none_never_guessed() {
        let system = json!({
            "PowerState": "Paused",
            "Manufacturer": "",
            "SerialNumber": "   ",
            "ProcessorSummary": { "Count": 5_000_000_000u64 },
            "MemorySummary": { "TotalSystemMemoryGiB": -1 },
        });
        assert_eq!(system_info(&system, None), SystemInfo::default());
        for (state, want) in
            [("PoweringOn", PowerState::PoweringOn), ("PoweringOff", PowerState::PoweringOff), ("Off", PowerState::Off)]
        {
            assert_eq!(system_info(&json!({ "PowerState": state }), None).power_state, Some(want));
        }
    }

    #[test]
    fn a_boot_override_counts_only_when_it_is_once_and_a_target_this_project_sets() {
        let boot = |enabled: &str, target: &str| {
            boot_once(&json!({ "Boot": { "BootSourceOverrideEnabled": enabled, "BootSourceOverrideTarget": target } }))
        };
        assert_eq!(boot("Once", "Cd"), Some(BootSource::Cd));
        assert_eq!(boot("Once", "Hdd"), Some(BootSource::Hdd));
        assert_eq!(boot("Continuous", "Cd"), None, "a continuous override is a setting, not a pending boot");
        assert_eq!(boot("Disabled", "Pxe"), None);
        assert_eq!(boot("Once", "UefiHttp"), None);
        assert_eq!(boot_once(&json!({ "Boot": { "BootSourceOverrideEnabled": "Once" } })), None);
        assert_eq!(boot_once(&json!({})), None);
    }

    #[test]
    fn the_media_image_is_the_inserted_one() {
        assert_eq!(media_image(&json!({ "Image": "http://x/a.iso", "Inserted": true })).as_deref(), Some("http://x/a.iso"));
        assert_eq!(media_image(&json!({ "Image": "http://x/a.iso" })).as_deref(), Some("http://x/a.iso"), "no Inserted field");
        assert_eq!(media_image(&json!({ "Image": "http://x/a.iso", "Inserted": false })), None);
        assert_eq!(media_image(&json!({ "Image": "", "Inserted": false })), None);
        assert_eq!(media_image(&json!({ "Image": null, "Inserted": true })), None);
        assert!(is_inserted(&json!({ "Image": "", "Inserted": true })), "inserted without an image still ejects");
        assert!(!is_inserted(&json!({ "Image": "", "Inserted": false })));
    }

    #[test]
    fn the_cd_drive_is_the_member_with_cd_or_dvd_media() {
        assert!(is_cd_drive(&json!({ "MediaTypes": ["CD", "DVD"] })));
        assert!(is_cd_drive(&json!({ "MediaTypes": ["DVD"] })));
        assert!(!is_cd_drive(&json!({ "MediaTypes": ["Floppy", "USBStick"] })));
        assert!(!is_cd_drive(&json!({})));
        let system = idrac_system();
        assert_eq!(links_managed_by(&system), ["/redfish/v1/Managers/iDRAC.Embedded.1"]);
        assert!(links_managed_by(&json!({ "Links": {} })).is_empty());
    }

    #[test]
    fn the_only_system_is_found_and_several_are_named() {
        let one = json!({ "Members": [{ "@odata.id": "/redfish/v1/Systems/1" }] });
        assert_eq!(only_member(&one, SYSTEMS_PATH).unwrap(), "/redfish/v1/Systems/1");
        let two = json!({ "Members": [{ "@odata.id": "/redfish/v1/Systems/a" }, { "@odata.id": "/redfish/v1/Systems/b" }] });
        let BmcError::Protocol(message) = only_member(&two, SYSTEMS_PATH).unwrap_err() else { panic!() };
        assert!(message.contains("/redfish/v1/Systems/a, /redfish/v1/Systems/b"), "{message}");
        assert!(message.contains("system path"), "{message}");
        assert!(matches!(only_member(&json!({ "Members": [] }), SYSTEMS_PATH), Err(BmcError::Protocol(_))));
        assert!(matches!(only_member(&json!({}), SYSTEMS_PATH), Err(BmcError::Protocol(_))));
    }

    #[test]
    fn action_targets_are_read_from_the_resource() {
        assert_eq!(
            action_target(&idrac_system(), "#ComputerSystem.Reset").unwrap(),
            "/redfish/v1/Systems/System.Embedded.1/Actions/ComputerSystem.Reset"
        );
        let BmcError::Protocol(message) = action_target(&idrac_system(), "#VirtualMedia.InsertMedia").unwrap_err() else {
            panic!()
        };
        assert!(message.contains("/redfish/v1/Systems/System.Embedded.1 offers no #VirtualMedia.InsertMedia"), "{message}");
    }

    #[test]
    fn redfish_error_messages_are_read_and_bounded() {
        let body = json!({ "error": { "code": "Base.1.8.GeneralError", "message": "A general error has occurred." } });
        assert_eq!(error_message(body.to_string().as_bytes()).as_deref(), Some("A general error has occurred."));
        let body = json!({ "error": { "code": "Base.1.8.GeneralError", "message": "See ExtendedInfo.", "@Message.ExtendedInfo": [
            { "MessageId": "Base.1.8.PropertyValueNotInList", "Message": "The value Floppy for BootSourceOverrideTarget is not in the list." },
            { "MessageId": "IDRAC.2.5.SYS403", "Message": "Unable to complete the operation." }
        ] } });
        assert_eq!(
            error_message(body.to_string().as_bytes()).as_deref(),
            Some(
                "See ExtendedInfo.; The value Floppy for BootSourceOverrideTarget is not in the list.; Unable to complete the operation."
            )
        );
        let body = json!({ "error": { "@Message.ExtendedInfo": [{ "Message": "Only this." }] } });
        assert_eq!(error_message(body.to_string().as_bytes()).as_deref(), Some("Only this."));
        assert_eq!(error_message(br#"{"error": {"code": "X"}}"#), None);
        assert_eq!(error_message(b"<html>Bad Gateway: db_password=s3cret</html>"), None, "a raw body is never carried");
        assert_eq!(error_message(br#"{"db_password": "s3cret"}"#), None, "nor JSON that is not a Redfish error");
        assert_eq!(error_message(b""), None);
        let long = json!({ "error": { "message": "x".repeat(5000) } }).to_string();
        assert_eq!(error_message(long.as_bytes()).unwrap().chars().count(), MESSAGE_CHARS_MAX + 1, "cut, with an ellipsis");
    }

    #[test]
    fn only_an_https_origin_is_a_bmc_address() {
        for address in ["https://10.0.0.5", "https://bmc.example:8443/", "https://[fd00::5]:443"] {
            assert!(RedfishBmc::new(&target(address, BmcTls::Insecure), &lab()).is_ok(), "{address}");
        }
        let refused = |address: &str| match RedfishBmc::new(&target(address, BmcTls::Insecure), &lab()) {
            Err(BmcError::Protocol(message)) => message,
            other => panic!("{address}: {other:?}"),
        };
        assert!(refused("http://10.0.0.5").contains("must be https://"));
        assert!(refused("https://root:calvin@10.0.0.5").contains("carries credentials"));
        assert!(!refused("https://root:calvin@10.0.0.5").contains("calvin"));
        assert!(refused("https://10.0.0.5/redfish/v1").contains("origin only"));
        let mut with_path = target("https://10.0.0.5", BmcTls::Insecure);
        with_path.system_path = Some("Systems/1".into());
        assert!(matches!(RedfishBmc::new(&with_path, &lab()), Err(BmcError::Protocol(_))));
    }

    #[test]
    fn links_stay_on_the_bmc() {
        let bmc = RedfishBmc::new(&target("https://10.0.0.5:8443", BmcTls::Insecure), &lab()).unwrap();
        assert_eq!(bmc.url_of("/redfish/v1/Systems/1").unwrap().as_str(), "https://10.0.0.5:8443/redfish/v1/Systems/1");
        assert_eq!(bmc.url_of("https://10.0.0.5:8443/redfish/v1").unwrap().as_str(), "https://10.0.0.5:8443/redfish/v1");
        for away in
            ["//evil.example/redfish/v1", "https://evil.example/redfish/v1", "https://10.0.0.5:443/x", "http://10.0.0.5:8443/x"]
        {
            assert!(matches!(bmc.url_of(away), Err(BmcError::Protocol(_))), "{away}");
        }
    }

    #[test]
    fn the_password_is_in_no_debug_output() {
        let bmc = RedfishBmc::new(&target("https://10.0.0.5", BmcTls::Insecure), &lab()).unwrap();
        let debug = format!("{bmc:?} {:?}", target("https://10.0.0.5", BmcTls::Insecure));
        assert!(!debug.contains("hunter2"), "{debug}");
        assert!(debug.contains("<redacted>"), "{debug}");
    }

    #[test]
    fn tls_settings_are_checked_when_the_client_is_made() {
        let bad = |tls: BmcTls| matches!(RedfishBmc::new(&target("https://10.0.0.5", tls), &lab()), Err(BmcError::Protocol(_)));
        assert!(bad(BmcTls::CaBundle { pem: String::new() }), "no certificate");
        assert!(bad(BmcTls::CaBundle { pem: "-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n".into() }));
        assert!(bad(BmcTls::Pin { pin: "sha256/short".into() }));
        assert!(bad(BmcTls::Pin { pin: format!("sha1/{}", base64::engine::general_purpose::STANDARD.encode([0u8; 32])) }));
        let pin = format!("sha256/{}", base64::engine::general_purpose::STANDARD.encode([7u8; 32]));
        assert!(!bad(BmcTls::Pin { pin }));
    }

    /// A certificate whose key is `key`, signed by itself.
    fn certificate(key: &rcgen::KeyPair) -> CertificateDer<'static> {
        let params = rcgen::CertificateParams::new(vec!["bmc.example".to_owned()]).unwrap();
        params.self_signed(key).unwrap().der().clone()
    }

    /// A BMC's self-signed certificate that is its own CA, given as its own CA bundle: webpki
    /// refuses it (`CaUsedAsEndEntity`), and the refusal says to pin it, with the key to pin.
    #[test]
    fn a_certificate_that_is_its_own_ca_is_refused_with_the_pin_to_use() {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["bmc.example".to_owned()]).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let cert = params.self_signed(&key).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let inner =
            rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(ca_roots(&cert.pem()).unwrap()), provider)
                .build()
                .unwrap();
        let verifier = ca_verifier(inner, Arc::new(rustls::crypto::ring::default_provider()));
        let name = ServerName::try_from("bmc.example").unwrap();
        let refused = verifier.verify_server_cert(cert.der(), &[], &name, &[], UnixTime::now()).unwrap_err();
        let text = chain(&std::io::Error::other(refused));
        let pin = spki_pin(cert.der()).unwrap();
        assert!(text.contains("CaUsedAsEndEntity"), "{text}");
        assert!(text.contains(&format!("trust it by its key instead: --bmc-pin {pin}")), "{text}");
    }

    #[test]
    fn the_pin_verifier_accepts_exactly_the_pinned_key() {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let key = rcgen::KeyPair::generate().unwrap();
        let leaf = certificate(&key);
        let pin = format!(
            "sha256/{}",
            base64::engine::general_purpose::STANDARD.encode(Sha256::digest(rcgen::PublicKeyData::subject_public_key_info(&key)))
        );
        assert_eq!(spki_pin(&leaf).unwrap(), pin, "the pin is of the DER SubjectPublicKeyInfo");
        let verifier = pin_verifier(&pin, provider.clone()).unwrap();
        let name = ServerName::try_from("another.name.example").unwrap();
        let now = UnixTime::now();
        assert!(verifier.verify_server_cert(&leaf, &[], &name, &[], now).is_ok(), "whatever name the server has");

        // The same key in another certificate is still the pinned key.
        let again = certificate(&key);
        assert_ne!(again, leaf);
        assert!(verifier.verify_server_cert(&again, &[], &name, &[], now).is_ok());

        let other = certificate(&rcgen::KeyPair::generate().unwrap());
        let refused = verifier.verify_server_cert(&other, &[], &name, &[], now).unwrap_err();
        assert!(matches!(refused, rustls::Error::InvalidCertificate(rustls::CertificateError::Other(_))), "{refused:?}");
        let other_pin = spki_pin(&other).unwrap();
        let wrapped = std::io::Error::other(refused);
        let text = chain(&wrapped);
        assert!(
            text.ends_with(&format!("invalid peer certificate: the BMC's certificate key is {other_pin}, not the pinned key")),
            "{text}"
        );
        // The pinned certificate sent as an intermediate behind another leaf is not the leaf.
        assert!(verifier.verify_server_cert(&other, std::slice::from_ref(&leaf), &name, &[], now).is_err());
        let garbage = CertificateDer::from(vec![0x30, 0x03, 0x02, 0x01, 0x00]);
        assert!(verifier.verify_server_cert(&garbage, &[], &name, &[], now).is_err());
        assert!(!verifier.supported_verify_schemes().is_empty(), "handshake signatures are still checked");
    }
}
