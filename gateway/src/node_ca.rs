//! The deployment's node CA: the X.509 authority that certifies each node's own key for mutual
//! TLS on the agents' endpoint (docs/admission.md).
//!
//! The CA is an ECDSA P-256 key with a self-signed certificate, made at the first start and kept
//! in the `secrets` table of the root tenant (row [`NODE_CA_SECRET_ID`], the key and the
//! certificate in one value, so two servers racing on an empty database agree on one CA: the
//! second insert fails on the row's key and that server reads the first one's), sealed at rest
//! under the data key like every other secret, never in the log or a projection.
//!
//! A node certificate is issued at join and renewed on the node's session, for the node's own
//! Ed25519 key (the private half never leaves the node): short-lived ([`NodeCa::lifetime_ms`],
//! `--node-cert-lifetime`, between [`NODE_CERT_LIFETIME_MS_MIN`] and
//! [`NODE_CERT_LIFETIME_MS_MAX`]), the node's id as its common name, client authentication
//! only. Each issue is an event (`node.certificate_issued`), with its serial and validity.
//!
//! `pki renew-ca` rolls the CA ([`NodeCa::renew`]): a new key and certificate become current
//! (every certificate from then on is the new CA's), and the replaced CA's certificate is kept
//! beside it, trusted until its overlap ends ([`NODE_CA_OVERLAP_MS_DEFAULT`], `--overlap`), so
//! nodes holding its certificates keep connecting until they renew. Each process reads the row
//! again every [`NODE_CA_REFRESH_MS`] ([`NodeCa::refresh`]); the TLS layer checks a certificate
//! against the current CA, then each replaced one whose overlap has not ended at the handshake.
//!
//! Revocation is by key: `nodes.revoke` (and `nodes.delete`) puts the node's key's SPKI pin in
//! this process's revoked set, which the TLS layer checks on every handshake
//! ([`NodeCertVerifier`]: a revoked certificate is refused with the `certificate_revoked`
//! alert), and wakes every session of this process ([`NodeCa::revocations`]) so the node's ends
//! at once. The set is loaded from the nodes' documents at start ([`NodeCa::load_revoked`]).

use std::collections::HashSet;
use std::sync::{Arc, RwLock};

use base64::Engine;
use bc_core::id::TenantId;
use bc_core::store::EventStore;
use bc_core::{Error, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SerialNumber,
};
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName as TlsName, SignatureScheme};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::watch;

/// The `secrets` row (root tenant) that holds the CA's key and certificate, sealed.
pub const NODE_CA_SECRET_ID: &str = "node-ca/v1";
/// The CA certificate's public PEM, beside the log key in the data directory: what `pki show`
/// names and what an outside verifier (`openssl verify -CAfile`) reads.
pub const NODE_CA_FILE: &str = "node-ca.crt";
/// The CA certificate's common name.
pub const NODE_CA_COMMON_NAME: &str = "better-compute node CA";
/// How long the CA certificate is valid from its making.
pub const NODE_CA_LIFETIME_MS: u64 = 10 * 365 * 24 * 3_600_000;
/// A node certificate's lifetime (`--node-cert-lifetime`): a day by default.
pub const NODE_CERT_LIFETIME_MS_DEFAULT: u64 = 24 * 3_600_000;
/// The shortest lifetime taken: a node renews at two thirds of it, so a minute leaves 20 s.
pub const NODE_CERT_LIFETIME_MS_MIN: u64 = 60_000;
/// The longest lifetime taken: a revoked node's certificate is refused at once anyway, but a
/// certificate copied off a node before its revocation should not outlive a month.
pub const NODE_CERT_LIFETIME_MS_MAX: u64 = 30 * 24 * 3_600_000;
const _: () = assert!(NODE_CERT_LIFETIME_MS_MIN <= NODE_CERT_LIFETIME_MS_DEFAULT);
const _: () = assert!(NODE_CERT_LIFETIME_MS_DEFAULT <= NODE_CERT_LIFETIME_MS_MAX);
const _: () = assert!(NODE_CERT_LIFETIME_MS_MAX < NODE_CA_LIFETIME_MS);
/// A certificate's `notBefore` is this far before its issue, for nodes whose clock is behind.
pub const NODE_CERT_BACKDATE_MS: u64 = 60_000;
/// The code (the start of the gRPC status message) a revoked node's session ends with, which
/// `bcd node` turns into `agent: this node's certificate was revoked` and exit 1.
pub const NODE_REVOKED_CODE: &str = bc_proto::NODE_REVOKED_CODE;
/// How long a replaced CA still verifies after `pki renew-ca`, unless `--overlap` says: two
/// days, past the default certificate's lifetime, so every node has renewed onto the new CA
/// before the old one stops verifying.
pub const NODE_CA_OVERLAP_MS_DEFAULT: u64 = 48 * 3_600_000;
/// The shortest and longest overlap `--overlap` takes.
pub const NODE_CA_OVERLAP_MS_MIN: u64 = 3_600_000;
pub const NODE_CA_OVERLAP_MS_MAX: u64 = 60 * 24 * 3_600_000;
const _: () =
    assert!(NODE_CA_OVERLAP_MS_MIN <= NODE_CA_OVERLAP_MS_DEFAULT && NODE_CA_OVERLAP_MS_DEFAULT <= NODE_CA_OVERLAP_MS_MAX);
const _: () = assert!(NODE_CERT_LIFETIME_MS_MAX <= NODE_CA_OVERLAP_MS_MAX);
/// Replaced CAs still in their overlap, at most: a renewal past them is refused until the
/// oldest overlap ends.
pub const NODE_CA_PREVIOUS_MAX: usize = 4;
/// How often a process reads the CA's row again for a renewal another process made.
pub const NODE_CA_REFRESH_MS: u64 = 2_000;
/// The test-only overlap, in milliseconds: set in a debug build, `pki renew-ca` uses it instead
/// of `--overlap` and its bounds, so the end-to-end test sees an overlap end. A release build
/// ignores it.
pub const NODE_CA_OVERLAP_MS_ENV: &str = "BC_TEST_ONLY_NODE_CA_OVERLAP_MS";

/// The overlap a renewal uses: `asked`, or in a debug build the test-only one when it is set.
pub fn overlap_ms(asked: u64) -> u64 {
    let test_only = cfg!(debug_assertions).then(|| std::env::var(NODE_CA_OVERLAP_MS_ENV).ok()?.parse().ok()).flatten();
    test_only.unwrap_or(asked)
}

/// Nodes whose documents are read per page when the revoked set is loaded at start.
const REVOKED_LOAD_PAGE: u32 = 500;

/// The CA's key (PKCS#8 PEM) and certificate (PEM), as the secret holds them, and the CAs it
/// replaced that are still in their overlap.
#[derive(Serialize, Deserialize)]
struct Stored {
    key: String,
    certificate: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    previous: Vec<PreviousCa>,
}

/// A replaced CA's certificate (PEM; its key is not kept: it issues nothing), trusted until
/// `until_ms`.
#[derive(Clone, Serialize, Deserialize)]
struct PreviousCa {
    certificate: String,
    until_ms: u64,
}

/// What `pki renew-ca` did.
#[derive(Clone, Debug)]
pub struct Renewed {
    /// The new CA's pin, and the replaced one's, which verifies until `overlap_ends_at_ms`.
    pub pin: String,
    pub previous_pin: String,
    pub overlap_ends_at_ms: u64,
    /// Every CA certificate trusted now (PEM, the new one first): what `node-ca.crt` holds.
    pub trusted_pem: String,
}

/// One reading of the CA's row: the current CA, which issues, and the replaced ones.
struct Generation {
    /// The row's value this was read from: a refresh that reads the same changes nothing.
    text: String,
    issuer: Issuer<'static, KeyPair>,
    certificate: CertificateDer<'static>,
    certificate_pem: String,
    pin: String,
    /// The current CA's verifier, then each replaced CA's with the end of its overlap.
    verifier: Arc<dyn ClientCertVerifier>,
    previous: Vec<(PreviousCa, String, Arc<dyn ClientCertVerifier>)>,
}

/// One node certificate as issued: its DER, serial (hex) and validity.
#[derive(Clone, Debug)]
pub struct IssuedCertificate {
    pub der: Vec<u8>,
    pub serial: String,
    pub not_before_ms: u64,
    pub not_after_ms: u64,
}

impl IssuedCertificate {
    /// The `node.certificate_issued` event that records it (on the node's stream).
    pub fn event(&self, renewal: bool) -> Result<bc_core::store::NewEvent> {
        let payload = bc_projections::events::NodeCertificateIssued {
            serial: self.serial.clone(),
            not_before_ms: self.not_before_ms,
            not_after_ms: self.not_after_ms,
            renewal,
        };
        Ok(bc_core::store::NewEvent::new(
            bc_projections::events::NODE_CERTIFICATE_ISSUED,
            bc_projections::events::to_cbor(&payload)?,
        ))
    }
}

/// The deployment's node CA and this process's revoked set.
pub struct NodeCa {
    /// Swapped whole when a refresh reads a renewal.
    generation: RwLock<Arc<Generation>>,
    lifetime_ms: u64,
    /// The SPKI pins of revoked nodes' keys: refused by the TLS layer.
    revoked: RwLock<HashSet<String>>,
    /// Bumped at each revocation, so every session of this process checks its node.
    revocations: watch::Sender<u64>,
}

impl std::fmt::Debug for NodeCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeCa").field("pin", &self.pin()).field("lifetime_ms", &self.lifetime_ms).finish_non_exhaustive()
    }
}

/// The CA certificate's parameters; the issuer of every node certificate is named from them.
fn ca_params(now_ms: u64) -> Result<CertificateParams> {
    let mut params = CertificateParams::default();
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, NODE_CA_COMMON_NAME);
    params.distinguished_name = name;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    params.not_before = time_of(now_ms)?;
    params.not_after = time_of(now_ms.saturating_add(NODE_CA_LIFETIME_MS))?;
    Ok(params)
}

fn time_of(ms: u64) -> Result<time::OffsetDateTime> {
    let secs = i64::try_from(ms / 1000).map_err(|_| Error::invalid("a time past 2^63 seconds"))?;
    time::OffsetDateTime::from_unix_timestamp(secs).map_err(|e| Error::invalid(format!("a time out of range: {e}")))
}

fn internal(what: &str) -> impl Fn(rcgen::Error) -> Error + '_ {
    move |e| Error::Internal(format!("{what}: {e}"))
}

/// The Ed25519 public key a node certificate certifies (rcgen takes the raw 32 bytes).
struct NodeKey<'a>(&'a [u8; 32]);

impl rcgen::PublicKeyData for NodeKey<'_> {
    fn der_bytes(&self) -> &[u8] {
        self.0
    }

    fn algorithm(&self) -> &'static rcgen::SignatureAlgorithm {
        &rcgen::PKCS_ED25519
    }
}

/// `sha256/` + base64 of SHA-256 over an Ed25519 key's SubjectPublicKeyInfo: the pin of the
/// key a node certificate certifies, as `bc_pin::spki_pin` computes it from the certificate.
pub fn node_key_pin(public_key: &[u8; 32]) -> String {
    // SEQUENCE { SEQUENCE { OID 1.3.101.112 }, BIT STRING { 0 unused bits, key } }.
    const PREFIX: [u8; 12] = [0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00];
    let digest = Sha256::new().chain_update(PREFIX).chain_update(public_key).finalize();
    format!("sha256/{}", base64::engine::general_purpose::STANDARD.encode(digest))
}

/// Whether `lifetime_ms` is within the bounds.
pub fn check_lifetime(lifetime_ms: u64) -> Result<()> {
    if !(NODE_CERT_LIFETIME_MS_MIN..=NODE_CERT_LIFETIME_MS_MAX).contains(&lifetime_ms) {
        return Err(Error::invalid(format!(
            "a node certificate's lifetime is {} s to {} s, not {} ms",
            NODE_CERT_LIFETIME_MS_MIN / 1000,
            NODE_CERT_LIFETIME_MS_MAX / 1000,
            lifetime_ms
        )));
    }
    Ok(())
}

fn corrupt(what: String) -> Error {
    Error::Corrupt { tenant: TenantId::ROOT.to_string(), seq: 0, what: format!("secret {NODE_CA_SECRET_ID}: {what}") }
}

fn parse_stored(text: &str) -> Result<Stored> {
    serde_json::from_str(text).map_err(|e| corrupt(format!("does not parse: {e}")))
}

/// A CA certificate from its PEM, and its pin.
fn ca_certificate(pem: &str) -> Result<(CertificateDer<'static>, String)> {
    use rustls::pki_types::pem::PemObject;
    let certificate = CertificateDer::from_pem_slice(pem.as_bytes()).map_err(|e| corrupt(format!("a certificate: {e}")))?;
    let pin = bc_pin::spki_pin(&certificate).map_err(|e| corrupt(e.to_string()))?;
    Ok((certificate, pin))
}

/// webpki's client verifier with `root` alone; client authentication offered, not required.
fn verifier_of(root: &CertificateDer<'static>) -> Result<Arc<dyn ClientCertVerifier>> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(root.clone()).map_err(|e| Error::Internal(format!("the node CA as a root: {e}")))?;
    rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        Arc::new(rustls::crypto::ring::default_provider()),
    )
    .allow_unauthenticated()
    .build()
    .map(|verifier| verifier as Arc<dyn ClientCertVerifier>)
    .map_err(|e| Error::Internal(format!("the node certificate verifier: {e}")))
}

impl Generation {
    fn of(text: &str) -> Result<Self> {
        let stored = parse_stored(text)?;
        let key = KeyPair::from_pem(&stored.key).map_err(|e| corrupt(format!("the key: {e}")))?;
        let (certificate, pin) = ca_certificate(&stored.certificate)?;
        let verifier = verifier_of(&certificate)?;
        let mut previous = Vec::with_capacity(stored.previous.len());
        for replaced in stored.previous {
            let (certificate, pin) = ca_certificate(&replaced.certificate)?;
            let verifier = verifier_of(&certificate)?;
            previous.push((replaced, pin, verifier));
        }
        // The issuer's name and key identifier are the certificate's: same subject, same key.
        let issuer = Issuer::new(ca_params(0)?, key);
        Ok(Self { text: text.to_owned(), issuer, certificate, certificate_pem: stored.certificate, pin, verifier, previous })
    }
}

impl NodeCa {
    fn from_text(text: &str, lifetime_ms: u64) -> Result<Self> {
        Ok(Self {
            generation: RwLock::new(Arc::new(Generation::of(text)?)),
            lifetime_ms,
            revoked: RwLock::new(HashSet::new()),
            revocations: watch::channel(0).0,
        })
    }

    fn generation(&self) -> Arc<Generation> {
        self.generation.read().expect("the CA's generation is never poisoned").clone()
    }

    /// A new CA (its key from the OS's randomness, never from a seed).
    fn make(now_ms: u64) -> Result<Stored> {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(internal("making the node CA's key"))?;
        let certificate = ca_params(now_ms)?.self_signed(&key).map_err(internal("making the node CA's certificate"))?;
        Ok(Stored { key: key.serialize_pem(), certificate: certificate.pem(), previous: Vec::new() })
    }

    /// `pki renew-ca`: a new CA becomes current in the stored row; the one it replaces verifies
    /// until `overlap_ms` from `now_ms` (and those replaced before it until their own ends).
    /// The row is replaced only if unchanged since it was read, so two renewals racing make one.
    pub async fn renew(store: &dyn EventStore, now_ms: u64, overlap_ms: u64) -> Result<Renewed> {
        let keys = store.data_keys().ok_or_else(|| Error::Internal("renewing the node CA needs the data key".into()))?;
        let Some(raw) = store.secret_get_raw(TenantId::ROOT, NODE_CA_SECRET_ID).await? else {
            return Err(Error::not_found("the node CA (start dev or serve once to make it)"));
        };
        let old = parse_stored(&keys.open(TenantId::ROOT, NODE_CA_SECRET_ID, &raw)?)?;
        let (_, previous_pin) = ca_certificate(&old.certificate)?;
        let mut previous: Vec<PreviousCa> = old.previous.into_iter().filter(|p| p.until_ms > now_ms).collect();
        if previous.len() >= NODE_CA_PREVIOUS_MAX {
            return Err(Error::state(
                format!("{NODE_CA_PREVIOUS_MAX} replaced node CAs are still in their overlap"),
                "renew again once the oldest overlap has ended (pki show lists them)",
            ));
        }
        let overlap_ends_at_ms = now_ms.saturating_add(overlap_ms);
        previous.insert(0, PreviousCa { certificate: old.certificate, until_ms: overlap_ends_at_ms });
        let mut new = Self::make(now_ms)?;
        new.previous = previous;
        let text = serde_json::to_string(&new).map_err(|e| Error::Internal(e.to_string()))?;
        let sealed = keys.seal(TenantId::ROOT, NODE_CA_SECRET_ID, &text)?;
        if !store.secret_replace_raw(&TenantId::ROOT.to_string(), NODE_CA_SECRET_ID, &raw, &sealed).await? {
            return Err(Error::Unavailable("the node CA was renewed at the same moment by another process; see pki show".into()));
        }
        let generation = Generation::of(&text)?;
        Ok(Renewed { pin: generation.pin.clone(), previous_pin, overlap_ends_at_ms, trusted_pem: generation.trusted_pem(now_ms) })
    }

    /// Reads the CA's row again: a renewal another process made becomes current here
    /// (`true`: it changed).
    pub async fn refresh(&self, store: &dyn EventStore) -> Result<bool> {
        let Some(text) = store.secret_get(TenantId::ROOT, NODE_CA_SECRET_ID).await? else { return Ok(false) };
        if text == self.generation().text {
            return Ok(false);
        }
        let generation = Arc::new(Generation::of(&text)?);
        tracing::info!(pin = %generation.pin, "the node CA was renewed");
        *self.generation.write().expect("the CA's generation is never poisoned") = generation;
        Ok(true)
    }

    /// Every CA certificate that verifies at `now_ms` (PEM, the current one first): what
    /// `node-ca.crt` holds, so an outside verifier trusts what the TLS layer trusts.
    pub fn trusted_pem(&self, now_ms: u64) -> String {
        self.generation().trusted_pem(now_ms)
    }

    /// The roll that made the current CA current, as `node_ca.renewed` says it (none: the CA
    /// was never renewed).
    pub fn renewal(&self) -> Option<bc_projections::events::NodeCaRenewed> {
        let generation = self.generation();
        generation.previous.first().map(|(replaced, previous_pin, _)| bc_projections::events::NodeCaRenewed {
            pin: generation.pin.clone(),
            previous_pin: previous_pin.clone(),
            overlap_ends_at_ms: replaced.until_ms,
        })
    }

    /// Appends `node_ca.renewed` for `renewed`, once whoever appends it (its idempotency key is
    /// named after the new CA's pin).
    pub async fn record_renewal(log: &bc_core::store::Log, renewed: &bc_projections::events::NodeCaRenewed) -> Result<()> {
        use bc_projections::node_ca::{NODE_CA_ACTOR, node_ca_renewed_key, node_ca_stream};
        let event =
            bc_core::store::NewEvent::new(bc_projections::events::NODE_CA_RENEWED, bc_projections::events::to_cbor(renewed)?);
        let mut request = bc_core::store::AppendRequest::new(
            TenantId::ROOT,
            node_ca_stream(),
            bc_core::store::ExpectedVersion::Any,
            NODE_CA_ACTOR,
            vec![event],
        );
        request.idempotency_key = Some(node_ca_renewed_key(&renewed.pin));
        log.append(request).await.map(|_| ())
    }

    /// The pins of the replaced CAs still in their overlap at `now_ms`, with its end.
    pub fn previous_pins(&self, now_ms: u64) -> Vec<(String, u64)> {
        self.generation()
            .previous
            .iter()
            .filter(|(p, _, _)| p.until_ms > now_ms)
            .map(|(p, pin, _)| (pin.clone(), p.until_ms))
            .collect()
    }

    /// The deployment's node CA, made and stored first if there is none (`true`: this call made
    /// it), issuing certificates of `lifetime_ms`.
    pub async fn load_or_create(store: &dyn EventStore, now_ms: u64, lifetime_ms: u64) -> Result<(Self, bool)> {
        check_lifetime(lifetime_ms)?;
        if let Some(ca) = Self::load(store, lifetime_ms).await? {
            return Ok((ca, false));
        }
        let made = Self::make(now_ms)?;
        let text = serde_json::to_string(&made).map_err(|e| Error::Internal(e.to_string()))?;
        match store.secret_put(TenantId::ROOT, NODE_CA_SECRET_ID, &text, now_ms).await {
            Ok(()) => Ok((Self::from_text(&text, lifetime_ms)?, true)),
            // Another server stored one at the same moment: that one is the deployment's.
            Err(put) => match Self::load(store, lifetime_ms).await? {
                Some(ca) => Ok((ca, false)),
                None => Err(put),
            },
        }
    }

    async fn load(store: &dyn EventStore, lifetime_ms: u64) -> Result<Option<Self>> {
        let Some(text) = store.secret_get(TenantId::ROOT, NODE_CA_SECRET_ID).await? else { return Ok(None) };
        Self::from_text(&text, lifetime_ms).map(Some)
    }

    /// The current CA certificate's key's pin (`sha256/…`): what `pki show` prints.
    pub fn pin(&self) -> String {
        self.generation().pin.clone()
    }

    /// The current CA certificate, DER and PEM.
    pub fn certificate(&self) -> CertificateDer<'static> {
        self.generation().certificate.clone()
    }

    pub fn certificate_pem(&self) -> String {
        self.generation().certificate_pem.clone()
    }

    /// How long a node certificate issued now is valid.
    pub fn lifetime_ms(&self) -> u64 {
        self.lifetime_ms
    }

    /// A certificate for `node`'s Ed25519 `public_key`, valid from a little before `now_ms`
    /// for the CA's lifetime, with `serial` (16 bytes, from the log's id source, so a run on
    /// a seed repeats it).
    pub fn issue(&self, node: &str, public_key: &[u8; 32], serial: [u8; 16], now_ms: u64) -> Result<IssuedCertificate> {
        let mut serial = serial;
        serial[0] &= 0x7f; // a positive INTEGER without a leading zero byte
        let not_before_ms = now_ms.saturating_sub(NODE_CERT_BACKDATE_MS);
        let not_after_ms = now_ms.saturating_add(self.lifetime_ms);
        let mut params = CertificateParams::default();
        let mut name = DistinguishedName::new();
        name.push(DnType::CommonName, node);
        params.distinguished_name = name;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.serial_number = Some(SerialNumber::from_slice(&serial));
        params.not_before = time_of(not_before_ms)?;
        params.not_after = time_of(not_after_ms)?;
        params.use_authority_key_identifier_extension = true;
        let made =
            params.signed_by(&NodeKey(public_key), &self.generation().issuer).map_err(internal("signing a node certificate"))?;
        Ok(IssuedCertificate { der: made.der().to_vec(), serial: hex::encode(serial), not_before_ms, not_after_ms })
    }

    /// Revokes the certificates of the node whose key is `public_key`: refused by the TLS
    /// layer from now on, and its sessions in this process woken to end.
    pub fn revoke(&self, public_key: &[u8; 32]) {
        let inserted = self.revoked.write().expect("the revoked set is never poisoned").insert(node_key_pin(public_key));
        if inserted {
            self.revocations.send_modify(|n| *n += 1);
        }
    }

    /// Whether the node whose key has this SPKI pin is revoked.
    pub fn is_revoked(&self, key_pin: &str) -> bool {
        self.revoked.read().expect("the revoked set is never poisoned").contains(key_pin)
    }

    /// Wakes at every revocation in this process: a session then checks its node.
    pub fn revocations(&self) -> watch::Receiver<u64> {
        self.revocations.subscribe()
    }

    /// Loads the revoked set from the nodes' documents (every tenant's, page by page); the
    /// number of revoked nodes found.
    pub async fn load_revoked(&self, store: &dyn EventStore) -> Result<usize> {
        let mut found = 0;
        for tenant in store.tenants().await? {
            let tenant = tenant.to_string();
            let mut after: Option<String> = None;
            loop {
                let page = store.row_list(&tenant, bc_projections::KIND_NODE, after.as_deref(), REVOKED_LOAD_PAGE).await?;
                let Some(last) = page.last() else { break };
                after = Some(last.key.id.clone());
                for row in page {
                    let doc: bc_projections::NodeDoc = crate::api::call::doc(row)?;
                    if let Some(agent) = doc.agent.filter(|a| a.revoked_at_ms > 0)
                        && let Some(key) =
                            bc_core::agent::unb64(&agent.public_key).ok().and_then(|k| <[u8; 32]>::try_from(k).ok())
                    {
                        self.revoke(&key);
                        found += 1;
                    }
                }
            }
        }
        Ok(found)
    }

    /// The TLS layer's check of a node's certificate: chained to the current CA (or to a
    /// replaced one whose overlap has not ended), valid now, for client authentication, and not
    /// revoked. Client authentication is offered, not required: a machine that has not joined
    /// yet, `bcd doctor` and the health probes present none (the session then asks for it:
    /// `agents::session`).
    pub fn client_verifier(self: &Arc<Self>) -> Result<Arc<dyn ClientCertVerifier>> {
        let inner = self.generation().verifier.clone();
        Ok(Arc::new(NodeCertVerifier { inner, ca: self.clone() }))
    }
}

impl Generation {
    fn trusted_pem(&self, now_ms: u64) -> String {
        let mut pem = self.certificate_pem.clone();
        for (replaced, _, _) in self.previous.iter().filter(|(p, _, _)| p.until_ms > now_ms) {
            if !pem.ends_with('\n') {
                pem.push('\n');
            }
            pem.push_str(&replaced.certificate);
        }
        pem
    }
}

/// [`NodeCa::client_verifier`]: webpki's verifier of the current CA, else of each replaced CA
/// still in its overlap at the handshake, then the revoked set.
#[derive(Debug)]
pub struct NodeCertVerifier {
    /// The verifier of the CA current when this was made: its hints and signature checks (the
    /// same for every CA: the schemes are the node keys', not the CA's).
    inner: Arc<dyn ClientCertVerifier>,
    ca: Arc<NodeCa>,
}

impl ClientCertVerifier for NodeCertVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[TlsName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> std::result::Result<ClientCertVerified, rustls::Error> {
        let generation = self.ca.generation();
        let now_ms = now.as_secs().saturating_mul(1000);
        let verified = match generation.verifier.verify_client_cert(end_entity, intermediates, now) {
            Ok(verified) => verified,
            Err(current) => generation
                .previous
                .iter()
                .filter(|(replaced, _, _)| replaced.until_ms > now_ms)
                .find_map(|(_, _, verifier)| verifier.verify_client_cert(end_entity, intermediates, now).ok())
                .ok_or(current)?,
        };
        let pin =
            bc_pin::spki_pin(end_entity).map_err(|_| rustls::Error::InvalidCertificate(rustls::CertificateError::BadEncoding))?;
        if self.ca.is_revoked(&pin) {
            return Err(rustls::Error::InvalidCertificate(rustls::CertificateError::Revoked));
        }
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ca() -> Arc<NodeCa> {
        let stored = NodeCa::make(1_800_000_000_000).unwrap();
        Arc::new(NodeCa::from_text(&serde_json::to_string(&stored).unwrap(), NODE_CERT_LIFETIME_MS_MIN * 2).unwrap())
    }

    #[test]
    fn a_node_certificate_chains_to_the_ca_and_certifies_the_nodes_key() {
        let ca = ca();
        let node_key = ed25519_dalek::SigningKey::from_bytes(&[7; 32]);
        let public = node_key.verifying_key().to_bytes();
        let now_ms = 1_800_000_100_000;
        let issued = ca.issue("node_01", &public, [0xff; 16], now_ms).unwrap();
        assert_eq!(issued.not_after_ms, now_ms + NODE_CERT_LIFETIME_MS_MIN * 2);
        assert_eq!(issued.not_before_ms, now_ms - NODE_CERT_BACKDATE_MS);
        assert!(issued.serial.starts_with("7f"), "the serial is positive: {}", issued.serial);
        let der = CertificateDer::from(issued.der.clone());
        assert_eq!(bc_pin::spki_pin(&der).unwrap(), node_key_pin(&public), "the certificate certifies the node's key");
        let verifier = ca.client_verifier().unwrap();
        let at = |ms: u64| UnixTime::since_unix_epoch(std::time::Duration::from_millis(ms));
        verifier.verify_client_cert(&der, &[], at(now_ms)).unwrap();
        let expired = verifier.verify_client_cert(&der, &[], at(issued.not_after_ms + 1000)).unwrap_err();
        assert!(
            matches!(
                expired,
                rustls::Error::InvalidCertificate(
                    rustls::CertificateError::Expired | rustls::CertificateError::ExpiredContext { .. }
                )
            ),
            "{expired:?}"
        );
        // Another CA's certificate for the same key is not this deployment's.
        let other = self::ca().issue("node_01", &public, [1; 16], now_ms).unwrap();
        assert!(verifier.verify_client_cert(&CertificateDer::from(other.der), &[], at(now_ms)).is_err());
        // Revoked: refused, and the sessions are woken.
        let woken = ca.revocations();
        ca.revoke(&public);
        assert!(woken.has_changed().unwrap());
        let revoked = verifier.verify_client_cert(&der, &[], at(now_ms)).unwrap_err();
        assert!(matches!(revoked, rustls::Error::InvalidCertificate(rustls::CertificateError::Revoked)), "{revoked:?}");
    }

    /// A renewed CA issues; the replaced one's certificates verify until its overlap ends, and
    /// `node-ca.crt` holds both until then.
    #[test]
    fn a_replaced_ca_verifies_until_its_overlap_ends() {
        let old = NodeCa::make(1_800_000_000_000).unwrap();
        let old_ca = Arc::new(NodeCa::from_text(&serde_json::to_string(&old).unwrap(), NODE_CERT_LIFETIME_MS_MAX).unwrap());
        let public = ed25519_dalek::SigningKey::from_bytes(&[9; 32]).verifying_key().to_bytes();
        let now_ms = 1_800_000_100_000;
        let old_certificate = CertificateDer::from(old_ca.issue("node_01", &public, [1; 16], now_ms).unwrap().der);
        let until_ms = now_ms + 3_600_000;
        let mut renewed = NodeCa::make(now_ms).unwrap();
        renewed.previous = vec![PreviousCa { certificate: old.certificate.clone(), until_ms }];
        let ca = Arc::new(NodeCa::from_text(&serde_json::to_string(&renewed).unwrap(), NODE_CERT_LIFETIME_MS_MAX).unwrap());
        assert_ne!(ca.pin(), old_ca.pin());
        assert_eq!(ca.previous_pins(now_ms), vec![(old_ca.pin(), until_ms)]);
        assert!(ca.previous_pins(until_ms).is_empty());
        assert_eq!(ca.trusted_pem(now_ms).matches("BEGIN CERTIFICATE").count(), 2);
        assert!(ca.trusted_pem(now_ms).starts_with(&ca.certificate_pem()), "the current CA first");
        assert_eq!(ca.trusted_pem(until_ms), ca.certificate_pem());
        let verifier = ca.client_verifier().unwrap();
        let at = |ms: u64| UnixTime::since_unix_epoch(std::time::Duration::from_millis(ms));
        verifier.verify_client_cert(&old_certificate, &[], at(until_ms - 1000)).expect("in the overlap");
        assert!(verifier.verify_client_cert(&old_certificate, &[], at(until_ms + 1000)).is_err(), "past the overlap");
        let new_certificate = CertificateDer::from(ca.issue("node_01", &public, [2; 16], now_ms).unwrap().der);
        verifier.verify_client_cert(&new_certificate, &[], at(until_ms + 1000)).expect("the new CA's");
        assert!(old_ca.client_verifier().unwrap().verify_client_cert(&new_certificate, &[], at(now_ms)).is_err());
    }

    #[test]
    fn a_lifetime_outside_its_bounds_is_refused() {
        assert!(check_lifetime(NODE_CERT_LIFETIME_MS_MIN - 1).is_err());
        assert!(check_lifetime(NODE_CERT_LIFETIME_MS_MAX + 1).is_err());
        check_lifetime(NODE_CERT_LIFETIME_MS_MIN).unwrap();
        check_lifetime(NODE_CERT_LIFETIME_MS_MAX).unwrap();
    }
}
