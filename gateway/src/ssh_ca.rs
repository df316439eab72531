//! The deployment's SSH user certificate authority: break-glass access to a node with an
//! OpenSSH user certificate that only that node accepts (`nodes.issueSshCert`), and its rotation
//! with a grace period (`pki rotate-ssh-ca`).
//!
//! Each CA is an Ed25519 key kept in the `secrets` table of the root tenant (the first, made at
//! the first start, in row [`SSH_USER_CA_SECRET_ID`]; generation N after it in
//! [`ssh_user_ca_secret_id`]`(N)`), so it is sealed at rest under the data key like every other
//! secret and is never in the log or a projection. Two servers starting on one empty database
//! both try to store the first; the second insert fails on the row's key and that server reads
//! the first one's key instead, so a deployment has exactly one CA of each generation.
//!
//! Which CA is current, and which replaced ones are still trusted until when, is the log's
//! `ssh_ca.rotated` events ([`bc_projections::decide::ssh_cert::SshCaState`]); [`SshUserCaRing`]
//! is this process's view of it. It reads the stream again (only what follows what it read) on
//! every certificate, so a certificate is signed by the new CA as soon as the rotation is in
//! the log, whichever process appended it; and every [`SSH_CA_REFRESH_MS`], and at each grace's
//! end, it publishes the trusted keys to the agents' sessions ([`SshUserCaRing::subscribe`]).
//!
//! Signing happens here, at the edge, from what `decide::ssh_cert_issue` decided and the log
//! holds (principal, validity, key id, serial): the nonce is derived from the appended event's
//! id, so an idempotent retry of the same call signs the very same certificate again. A
//! certificate carries one extension, `permit-pty`: no agent, port or X11 forwarding, no
//! `~/.ssh/rc`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bc_core::clock::Clock;
use bc_core::id::TenantId;
use bc_core::store::{EventStore, Log};
use bc_core::{Error, Result};
use bc_projections::decide::ssh_cert::{
    SSH_CA_ROTATED, SshCaRotateInput, SshCaRotated, SshCaState, TrustedCaKey, ssh_ca_rotate, ssh_ca_stream,
};
use sha2::{Digest, Sha256};
use ssh_key::certificate::{Builder, CertType};
use ssh_key::private::Ed25519Keypair;
use ssh_key::{Algorithm, Certificate, HashAlg, PrivateKey, PublicKey};
use tokio::sync::watch;

/// The `secrets` row (root tenant) that holds the first CA's 32-byte seed, hex, sealed.
pub const SSH_USER_CA_SECRET_ID: &str = "ssh-user-ca/v1";
/// The comment of the CA's public key line, so an operator reading `TrustedUserCAKeys` sees
/// whose key it is.
pub const SSH_USER_CA_COMMENT: &str = "better-compute-ssh-user-ca";
/// The longest public key line `nodes.issueSshCert` reads, in bytes: an Ed25519 line is about
/// 100, a P-521 one about 300; a comment makes up the rest.
pub const SSH_PUBLIC_KEY_BYTES_MAX: usize = 2048;
/// What the certificate's nonce is derived from, before the event id.
const NONCE_CONTEXT: &[u8] = b"better-compute/ssh-cert-nonce/v1\n";
/// How often a process reads the CA's stream for a rotation another process appended, and so
/// how long at most before the agents it serves trust a new CA.
pub const SSH_CA_REFRESH_MS: u64 = 2_000;
/// The actor of `ssh_ca.rotated`.
pub const SSH_CA_ACTOR: &str = "system:pki";

/// The extensions a certificate grants: a terminal, and nothing else (no agent, port or X11
/// forwarding, no `~/.ssh/rc`): break-glass is a shell on the node.
pub const SSH_CERT_EXTENSIONS: &[&str] = &["permit-pty"];

/// The `secrets` row of the CA of `generation` (1: the first, [`SSH_USER_CA_SECRET_ID`]).
pub fn ssh_user_ca_secret_id(generation: u32) -> String {
    match generation {
        0 | 1 => SSH_USER_CA_SECRET_ID.to_owned(),
        n => format!("{SSH_USER_CA_SECRET_ID}/{n}"),
    }
}

/// The deployment's SSH user CA.
pub struct SshUserCa {
    key: PrivateKey,
}

impl std::fmt::Debug for SshUserCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SshUserCa").field("fingerprint", &self.fingerprint()).finish_non_exhaustive()
    }
}

/// What one certificate says, as decided and appended (`node.ssh_cert_issued`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertificateOrder<'a> {
    /// The one principal: the node (and account) it is good for.
    pub principal: &'a str,
    pub key_id: &'a str,
    pub serial: u64,
    pub valid_after_s: u64,
    pub valid_before_s: u64,
    /// The appended event's id: the nonce is derived from it.
    pub event_id: &'a str,
}

impl SshUserCa {
    /// The CA from its 32-byte Ed25519 seed.
    pub fn from_seed(seed: &[u8; 32]) -> Self {
        let mut key = PrivateKey::from(Ed25519Keypair::from_seed(seed));
        key.set_comment(SSH_USER_CA_COMMENT);
        Self { key }
    }

    /// The CA of `generation` stored in `store` (root tenant), made and stored first if there is
    /// none. Returns whether this call made it.
    pub async fn load_or_create(store: &dyn EventStore, generation: u32, now_ms: u64) -> Result<(Self, bool)> {
        let id = ssh_user_ca_secret_id(generation);
        if let Some(ca) = Self::load(store, &id).await? {
            return Ok((ca, false));
        }
        // The CA's key is a secret: from the OS's randomness, never from a seed.
        let seed = rand::random::<[u8; 32]>();
        match store.secret_put(TenantId::ROOT, &id, &hex::encode(seed), now_ms).await {
            Ok(()) => Ok((Self::from_seed(&seed), true)),
            // Another server stored one at the same moment: that one is the deployment's.
            Err(put) => match Self::load(store, &id).await? {
                Some(ca) => Ok((ca, false)),
                None => Err(put),
            },
        }
    }

    async fn load(store: &dyn EventStore, id: &str) -> Result<Option<Self>> {
        let Some(text) = store.secret_get(TenantId::ROOT, id).await? else { return Ok(None) };
        let seed = hex::decode(text.trim()).ok().and_then(|b| <[u8; 32]>::try_from(b).ok()).ok_or_else(|| Error::Corrupt {
            tenant: TenantId::ROOT.to_string(),
            seq: 0,
            what: format!("secret {id} is not a 32-byte hex seed"),
        })?;
        Ok(Some(Self::from_seed(&seed)))
    }

    /// The CA's public key as one OpenSSH line (`ssh-ed25519 AAAA… better-compute-ssh-user-ca`).
    pub fn public_openssh(&self) -> String {
        self.key.public_key().to_openssh().expect("an Ed25519 public key encodes")
    }

    /// `SHA256:…`, as `ssh-keygen -l` prints it.
    pub fn fingerprint(&self) -> String {
        self.key.public_key().fingerprint(HashAlg::Sha256).to_string()
    }

    /// Signs a user certificate for `subject` as `order` says.
    pub fn sign(&self, subject: &PublicKey, order: &CertificateOrder<'_>) -> Result<Certificate> {
        let nonce = Sha256::new().chain_update(NONCE_CONTEXT).chain_update(order.event_id.as_bytes()).finalize();
        let failed = |e: ssh_key::Error| Error::Internal(format!("signing an SSH certificate: {e}"));
        let mut builder = Builder::new(nonce.to_vec(), subject.key_data().clone(), order.valid_after_s, order.valid_before_s)
            .map_err(failed)?;
        builder.serial(order.serial).map_err(failed)?;
        builder.cert_type(CertType::User).map_err(failed)?;
        builder.key_id(order.key_id).map_err(failed)?;
        builder.valid_principal(order.principal).map_err(failed)?;
        for extension in SSH_CERT_EXTENSIONS {
            builder.extension(*extension, "").map_err(failed)?;
        }
        builder.sign(&self.key).map_err(failed)
    }
}

/// Reads a caller's OpenSSH public key line: Ed25519 or ECDSA only, and never anything that
/// looks like a private key (which is refused without echoing any of it).
pub fn parse_user_public_key(field: &str, text: &str) -> Result<PublicKey> {
    let text = text.trim();
    if text.contains("PRIVATE KEY") {
        return Err(invalid_hint(
            format!("{field} holds a private key; send only the public key"),
            "the .pub file beside your key holds the public line (ssh-keygen -y -f KEY prints it)",
        ));
    }
    if text.len() > SSH_PUBLIC_KEY_BYTES_MAX {
        return Err(Error::invalid(format!("{field} is longer than {SSH_PUBLIC_KEY_BYTES_MAX} bytes")));
    }
    if text.contains('\n') {
        return Err(Error::invalid(format!("{field} must be one OpenSSH public key line")));
    }
    let key = PublicKey::from_openssh(text).map_err(|_| {
        invalid_hint(
            format!("{field} is not an OpenSSH public key"),
            "give the line of an id_ed25519.pub or id_ecdsa.pub file: `ssh-ed25519 AAAA… comment`",
        )
    })?;
    match key.algorithm() {
        Algorithm::Ed25519 | Algorithm::Ecdsa { .. } => Ok(key),
        other => Err(invalid_hint(
            format!("{field} is a {} key; only Ed25519 and ECDSA keys are certified", other.as_str()),
            "make one with ssh-keygen -t ed25519",
        )),
    }
}

fn invalid_hint(message: String, hint: &str) -> Error {
    Error::InvalidArgument { message, hint: Some(hint.to_owned()) }
}

/// The subject key's fingerprint, `SHA256:…`: what the event records of it.
pub fn public_key_fingerprint(key: &PublicKey) -> String {
    key.fingerprint(HashAlg::Sha256).to_string()
}

/// What this process knows of the deployment's CAs: the stream as read, and the current CA.
struct Known {
    state: SshCaState,
    current: Arc<SshUserCa>,
}

/// The deployment's SSH user CAs as this process knows them: the current one, which signs, and
/// the replaced ones still in their grace, which nodes trust beside it.
pub struct SshUserCaRing {
    store: Arc<dyn EventStore>,
    clock: Arc<dyn Clock>,
    /// Held while the stream is read, so one read at a time folds it.
    known: tokio::sync::Mutex<Known>,
    /// The keys nodes trust now, as last published, for the agents' sessions.
    trusted: watch::Sender<Vec<TrustedCaKey>>,
    /// Whether the task that publishes them ([`Self::subscribe`]) runs.
    publishing: AtomicBool,
}

/// What `pki rotate-ssh-ca` did.
#[derive(Clone, Debug)]
pub struct SshCaRotation {
    pub rotated: SshCaRotated,
    /// The event's sequence number in the root tenant's log.
    pub seq: u64,
    /// Whether the replaced CA's private key was deleted (it signs nothing any more).
    pub previous_key_deleted: bool,
}

impl std::fmt::Debug for SshUserCaRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SshUserCaRing").field("trusted", &*self.trusted.borrow()).finish_non_exhaustive()
    }
}

impl SshUserCaRing {
    /// The deployment's CAs: the first made and stored if there is none (`true`: this call made
    /// it), the log's rotations read, the current one's key loaded.
    pub async fn open(store: Arc<dyn EventStore>, clock: Arc<dyn Clock>) -> Result<(Self, bool)> {
        let mut state = SshCaState::default();
        read_rotations(&*store, &mut state).await?;
        // After a rotation the first CA's key is gone, and must not be made again.
        let (current, created) = match state.generation() {
            1 => SshUserCa::load_or_create(&*store, 1, clock.now_ms()).await?,
            generation => (load_generation(&*store, generation).await?, false),
        };
        let trusted = state.trusted_at(&current.public_openssh(), clock.now_ms());
        let known = Known { state, current: Arc::new(current) };
        let ring = Self {
            store,
            clock,
            known: tokio::sync::Mutex::new(known),
            trusted: watch::channel(trusted).0,
            publishing: AtomicBool::new(false),
        };
        Ok((ring, created))
    }

    /// Reads what the CA's stream gained since the last read; returns the state and the current
    /// CA, and publishes the keys trusted now if they changed.
    pub async fn refresh(&self) -> Result<(SshCaState, Arc<SshUserCa>)> {
        let mut known = self.known.lock().await;
        let mut state = known.state.clone();
        read_rotations(&*self.store, &mut state).await?;
        if state.generation() != known.state.generation() {
            let current = load_generation(&*self.store, state.generation()).await?;
            tracing::info!(generation = state.generation(), fingerprint = %current.fingerprint(), "the SSH user CA was rotated");
            known.current = Arc::new(current);
        }
        known.state = state;
        self.publish(&known);
        Ok((known.state.clone(), known.current.clone()))
    }

    /// The CA that signs now: the log's current one, read again first.
    pub async fn current(&self) -> Result<Arc<SshUserCa>> {
        Ok(self.refresh().await?.1)
    }

    /// The keys nodes trust now, as last published.
    pub fn trusted(&self) -> Vec<TrustedCaKey> {
        self.trusted.borrow().clone()
    }

    fn publish(&self, known: &Known) {
        let now = known.state.trusted_at(&known.current.public_openssh(), self.clock.now_ms());
        self.trusted.send_if_modified(|trusted| {
            let changed = *trusted != now;
            if changed {
                *trusted = now;
            }
            changed
        });
    }

    /// The keys nodes trust, now and whenever they change: the first subscriber starts the task
    /// that reads the stream every [`SSH_CA_REFRESH_MS`] and publishes at each grace's end,
    /// until `shutdown` turns true.
    pub fn subscribe(self: &Arc<Self>, shutdown: watch::Receiver<bool>) -> watch::Receiver<Vec<TrustedCaKey>> {
        if !self.publishing.swap(true, Ordering::SeqCst) {
            tokio::spawn(self.clone().keep_published(shutdown));
        }
        self.trusted.subscribe()
    }

    async fn keep_published(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        loop {
            let next_change = match self.refresh().await {
                Ok((state, _)) => state.next_change_after(self.clock.now_ms()),
                Err(e) => {
                    tracing::warn!(code = %e.code(), error = %e, "reading the SSH CA's rotations failed; retrying");
                    None
                }
            };
            let now = self.clock.now_ms();
            let wait_ms = next_change.map_or(SSH_CA_REFRESH_MS, |at| at.saturating_sub(now).clamp(1, SSH_CA_REFRESH_MS));
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(wait_ms)) => {}
                _ = shutdown.changed() => return,
            }
        }
    }

    /// Rotates the deployment's CA: makes the next generation's key (sealed like the first; one
    /// left by a rotation cut short, never announced, is taken), decides ([`ssh_ca_rotate`]),
    /// appends `ssh_ca.rotated` through `log`, then deletes the replaced CA's private key, which
    /// signs nothing any more (its public key stays trusted until the grace ends).
    pub async fn rotate(&self, log: &Log, grace_ms: u64) -> Result<SshCaRotation> {
        let (state, current) = self.refresh().await?;
        let generation = state.generation() + 1;
        let now_ms = self.clock.now_ms();
        let (new, _) = SshUserCa::load_or_create(&*self.store, generation, now_ms).await?;
        let (current_line, new_line) = (current.public_openssh(), new.public_openssh());
        let (current_fingerprint, new_fingerprint) = (current.fingerprint(), new.fingerprint());
        let input = SshCaRotateInput {
            current_public_key: &current_line,
            current_fingerprint: &current_fingerprint,
            new_public_key: &new_line,
            new_fingerprint: &new_fingerprint,
            grace_ms,
            now_ms,
        };
        let (append, rotated) = ssh_ca_rotate(&state, input)?;
        let appended = log.append(append.into_request(TenantId::ROOT, SSH_CA_ACTOR)).await?;
        let seq = appended.events.first().map(|e| e.envelope.seq).unwrap_or_default();
        let previous = ssh_user_ca_secret_id(generation - 1);
        let previous_key_deleted = match self.store.secret_delete(TenantId::ROOT, &previous).await {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(code = %e.code(), error = %e, secret = %previous, "deleting the replaced SSH CA's key failed");
                false
            }
        };
        self.refresh().await?;
        Ok(SshCaRotation { rotated, seq, previous_key_deleted })
    }
}

/// The keys trusted as the agents' protocol carries them (`Welcome`, `SshUserCaKeys`).
pub fn ssh_user_ca_keys(keys: &[TrustedCaKey]) -> bc_proto::SshUserCaKeys {
    bc_proto::SshUserCaKeys {
        keys: keys.iter().map(|k| k.public_key.clone()).collect(),
        until_ms: keys.iter().map(|k| k.until_ms.unwrap_or(0)).collect(),
    }
}

/// The trusted keys once they change ([`SshUserCaRing::subscribe`]); never, without a ring or
/// once it is gone.
pub async fn next_trusted(keys: &mut Option<watch::Receiver<Vec<TrustedCaKey>>>) -> Vec<TrustedCaKey> {
    let Some(receiver) = keys else { return std::future::pending().await };
    match receiver.changed().await {
        Ok(()) => receiver.borrow_and_update().clone(),
        Err(_) => {
            *keys = None;
            std::future::pending().await
        }
    }
}

/// Folds what the CA's stream holds after `state.version` into `state`.
pub async fn read_rotations(store: &dyn EventStore, state: &mut SshCaState) -> Result<()> {
    let stream = ssh_ca_stream();
    loop {
        let rows = store.read_stream_rows(TenantId::ROOT, &stream, state.version, bc_core::store::READ_ROWS_MAX).await?;
        if rows.is_empty() {
            return Ok(());
        }
        for event in bc_core::store::decode_rows(rows)? {
            let corrupt = |what: String| Error::Corrupt { tenant: TenantId::ROOT.to_string(), seq: event.envelope.seq, what };
            if event.envelope.event_type != SSH_CA_ROTATED {
                // A type this version does not know moves the version and nothing else.
                state.version = event.envelope.version;
                continue;
            }
            let rotated: SshCaRotated = serde_json::from_value(bc_core::canonical::to_json(&event.envelope.payload))
                .map_err(|e| corrupt(format!("{SSH_CA_ROTATED} does not parse: {e}")))?;
            state.apply(event.envelope.version, rotated).map_err(corrupt)?;
        }
    }
}

/// The CA of `generation` (after the first), which the log names current: its key must be there.
async fn load_generation(store: &dyn EventStore, generation: u32) -> Result<SshUserCa> {
    let id = ssh_user_ca_secret_id(generation);
    SshUserCa::load(store, &id).await?.ok_or_else(|| Error::Corrupt {
        tenant: TenantId::ROOT.to_string(),
        seq: 0,
        what: format!("the log names SSH CA generation {generation} current, and there is no secret {id}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SUBJECT: &str = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGPp5cSj0ubxLBNKS9nHc9vlsXR+lxeUHkpUqc6yIaLy me@laptop";

    fn order() -> CertificateOrder<'static> {
        CertificateOrder {
            principal: "bc-node:node_01:root",
            key_id: "apikey:key_01 node:node_01 request:req_01",
            serial: 42,
            valid_after_s: 1_000,
            valid_before_s: 1_960,
            event_id: "evt_01",
        }
    }

    #[test]
    fn a_certificate_says_what_was_ordered_and_verifies_under_the_ca() {
        let ca = SshUserCa::from_seed(&[7; 32]);
        let subject = parse_user_public_key("publicKey", SUBJECT).unwrap();
        let cert = ca.sign(&subject, &order()).unwrap();
        assert_eq!(cert.cert_type(), CertType::User);
        assert_eq!(cert.valid_principals(), ["bc-node:node_01:root".to_owned()]);
        assert_eq!(cert.key_id(), "apikey:key_01 node:node_01 request:req_01");
        assert_eq!((cert.serial(), cert.valid_after(), cert.valid_before()), (42, 1_000, 1_960));
        assert_eq!(cert.public_key(), subject.key_data());
        let extensions: Vec<&String> = cert.extensions().keys().collect();
        assert_eq!(extensions, ["permit-pty"], "a terminal and nothing else: no forwarding, no user rc");
        assert!(cert.critical_options().is_empty());
        let ca_fingerprint = ca.key.public_key().fingerprint(HashAlg::Sha256);
        cert.validate_at(1_500, [&ca_fingerprint]).unwrap();
        assert!(cert.validate_at(2_000, [&ca_fingerprint]).is_err(), "expired");
        let other = SshUserCa::from_seed(&[8; 32]).key.public_key().fingerprint(HashAlg::Sha256);
        assert!(cert.validate_at(1_500, [&other]).is_err(), "another CA");
    }

    #[test]
    fn the_same_order_signs_the_same_certificate() {
        let ca = SshUserCa::from_seed(&[7; 32]);
        let subject = parse_user_public_key("publicKey", SUBJECT).unwrap();
        let first = ca.sign(&subject, &order()).unwrap().to_openssh().unwrap();
        assert_eq!(first, ca.sign(&subject, &order()).unwrap().to_openssh().unwrap());
        let other = CertificateOrder { event_id: "evt_02", ..order() };
        assert_ne!(first, ca.sign(&subject, &other).unwrap().to_openssh().unwrap());
    }

    #[test]
    fn the_public_line_is_an_ed25519_openssh_key_with_its_comment() {
        let ca = SshUserCa::from_seed(&[7; 32]);
        let line = ca.public_openssh();
        assert!(line.starts_with("ssh-ed25519 AAAA"), "{line}");
        assert!(line.ends_with(SSH_USER_CA_COMMENT), "{line}");
        assert!(ca.fingerprint().starts_with("SHA256:"));
        assert!(!format!("{ca:?}").contains(&hex::encode([7u8; 32])));
    }

    #[test]
    fn only_ed25519_and_ecdsa_public_keys_are_read() {
        assert!(parse_user_public_key("publicKey", SUBJECT).is_ok());
        let ecdsa = "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBEmKSENjQEezOmxkZMy7opKgwFB9nkt5YRrYMjNuG5N87uRgg6CLrbo5wAdT/y6v0mKV0U2w0WZ2YB/++Tpockg= e@x";
        assert!(parse_user_public_key("publicKey", ecdsa).is_ok());
        let private = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----\n";
        let e = parse_user_public_key("publicKey", private).unwrap_err().to_string();
        assert!(e.contains("private key") && !e.contains("b3BlbnNzaC1rZXktdjEAAAAA"), "{e}");
        assert!(parse_user_public_key("publicKey", "ssh-ed25519 notbase64").is_err());
        assert!(parse_user_public_key("publicKey", &format!("{SUBJECT}\n{SUBJECT}")).is_err());
        let rsa = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAAAgQC7 x@y";
        assert!(parse_user_public_key("publicKey", rsa).is_err());
    }

    /// A fresh store with its schema, the log over it on a clock the test moves.
    async fn world(dir: &std::path::Path) -> (Arc<dyn EventStore>, Arc<bc_core::clock::ManualClock>, Log) {
        let store: Arc<dyn EventStore> =
            Arc::new(bc_core::store::sqlite::SqliteStore::open(&dir.join("log.sqlite3")).await.unwrap());
        store.migrate_at(0).await.unwrap();
        let clock = Arc::new(bc_core::clock::ManualClock::new(1_700_000_000_000));
        let key = Arc::new(bc_core::keys::LogKey::generate());
        let log = Log::open(store.clone(), Arc::new(bc_projections::Projections), key, clock.clone()).await.unwrap();
        (store, clock, log)
    }

    fn lines(keys: &[TrustedCaKey]) -> Vec<(String, Option<u64>)> {
        keys.iter().map(|k| (k.public_key.clone(), k.until_ms)).collect()
    }

    #[tokio::test]
    async fn a_rotation_signs_with_the_new_ca_at_once_everywhere_and_trusts_the_old_one_until_its_grace_ends() {
        let dir = tempfile::tempdir().unwrap();
        let (store, clock, log) = world(dir.path()).await;
        let (serving, created) = SshUserCaRing::open(store.clone(), clock.clone()).await.unwrap();
        assert!(created);
        let first = serving.current().await.unwrap();
        assert_eq!(lines(&serving.trusted()), [(first.public_openssh(), None)]);
        // The operator's command is another process, with its own view of the same database.
        let (operator, created) = SshUserCaRing::open(store.clone(), clock.clone()).await.unwrap();
        assert!(!created);
        let rotation = operator.rotate(&log, 60_000).await.unwrap();
        assert_eq!(
            (rotation.rotated.generation, rotation.rotated.previous_fingerprint.as_str()),
            (2, first.fingerprint().as_str())
        );
        assert!(rotation.previous_key_deleted);
        assert!(
            store.secret_get(TenantId::ROOT, SSH_USER_CA_SECRET_ID).await.unwrap().is_none(),
            "the old key signs nothing more"
        );
        // The serving process signs with the new CA on its next certificate, without a restart.
        let second = serving.current().await.unwrap();
        assert_eq!(second.fingerprint(), rotation.rotated.fingerprint);
        assert_ne!(second.fingerprint(), first.fingerprint());
        let until = clock.now_ms() + 60_000;
        assert_eq!(lines(&serving.trusted()), [(second.public_openssh(), None), (first.public_openssh(), Some(until))]);
        // A restart reads the same: the second CA, the first in its grace, no first CA made again.
        let (restarted, created) = SshUserCaRing::open(store.clone(), clock.clone()).await.unwrap();
        assert!(!created);
        assert_eq!(restarted.current().await.unwrap().fingerprint(), second.fingerprint());
        assert!(store.secret_get(TenantId::ROOT, SSH_USER_CA_SECRET_ID).await.unwrap().is_none());
        // Once the grace ends, the first is trusted no more.
        clock.advance_ms(60_000);
        serving.refresh().await.unwrap();
        assert_eq!(lines(&serving.trusted()), [(second.public_openssh(), None)]);
        // A process that read the log before another's rotation reads it again before its own,
        // so it replaces the CA that is current, never the one it had seen.
        let (behind, _) = SshUserCaRing::open(store.clone(), clock.clone()).await.unwrap();
        restarted.rotate(&log, 0).await.unwrap();
        let third = serving.current().await.unwrap();
        assert_eq!(lines(&serving.trusted()), [(third.public_openssh(), None)], "no grace: the second goes at once");
        let fourth = behind.rotate(&log, 0).await.unwrap();
        assert_eq!((fourth.rotated.generation, fourth.rotated.previous_fingerprint), (4, third.fingerprint()));
        assert_eq!(serving.current().await.unwrap().fingerprint(), fourth.rotated.fingerprint);
    }

    #[tokio::test]
    async fn subscribers_hear_of_a_rotation_and_of_a_grace_ending() {
        let dir = tempfile::tempdir().unwrap();
        let (store, clock, log) = world(dir.path()).await;
        let (ring, _) = SshUserCaRing::open(store.clone(), clock.clone()).await.unwrap();
        let ring = Arc::new(ring);
        let (stop, stopped) = watch::channel(false);
        let mut trusted = ring.subscribe(stopped);
        assert_eq!(trusted.borrow_and_update().len(), 1);
        let (operator, _) = SshUserCaRing::open(store.clone(), clock.clone()).await.unwrap();
        operator.rotate(&log, 1_000).await.unwrap();
        tokio::time::timeout(Duration::from_millis(SSH_CA_REFRESH_MS * 3), trusted.changed()).await.unwrap().unwrap();
        assert_eq!(trusted.borrow_and_update().len(), 2, "the new CA and the old one in its grace");
        clock.advance_ms(1_000);
        tokio::time::timeout(Duration::from_millis(SSH_CA_REFRESH_MS * 3), trusted.changed()).await.unwrap().unwrap();
        assert_eq!(trusted.borrow_and_update().len(), 1, "the grace ended");
        let _ = stop.send(true);
    }
}
