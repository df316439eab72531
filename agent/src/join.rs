//! `bcd join`: make the node key, spend the join token (sealed to the join encryption key when
//! the machine has it: `crate::well_known`), check the answer's join signature against the
//! pinned join signing key and the signed identity against the pinned log key, and write
//! `identity.json`. A machine that has joined says so and reads no
//! token; `--reset --yes` moves the identity and the journal aside first.

use std::path::{Path, PathBuf};
use std::time::Duration;

use bc_proto::agent_client::AgentClient;

use crate::config::{Config, IdentityFile, load_identity, node_key_load_or_create, verify_identity};
use crate::session::{Backoff, Rng, SystemRng};
use crate::token::{Source, Token};

/// Attempts at a join that fails in a way worth retrying.
pub const JOIN_ATTEMPTS_MAX: u32 = 20;
/// One attempt's deadline.
pub const JOIN_TIMEOUT_MS: u64 = 15_000;
/// The longest retry hint (`bc_proto::RETRY_PUSHBACK_MS_KEY`) a join waits for; a longer one
/// is taken as this.
pub const JOIN_PUSHBACK_MS_MAX: u64 = 60_000;

/// How a join ends: the message for standard output, or an error with its exit code.
pub enum Outcome {
    Joined(String),
    AlreadyJoined(String),
}

pub struct JoinError {
    pub exit: u8,
    pub message: String,
}

fn fail(message: impl Into<String>) -> JoinError {
    JoinError { exit: 1, message: message.into() }
}

pub fn usage(message: impl Into<String>) -> JoinError {
    JoinError { exit: 2, message: message.into() }
}

/// The files `--reset` moves aside.
pub fn reset_files(config: &Config) -> Vec<PathBuf> {
    let journal = config.journal_path();
    let mut files = vec![
        config.identity_path(),
        config.key_path(),
        crate::node_cert::NodeCertificateFile::path(&config.data_dir),
        journal.clone(),
    ];
    for suffix in ["-wal", "-shm"] {
        let mut companion = journal.clone().into_os_string();
        companion.push(suffix);
        files.push(companion.into());
    }
    files.into_iter().filter(|p| p.exists()).collect()
}

/// Moves this node's identity and journal to `NAME.reset-<ms>`.
pub fn reset(config: &Config, now_ms: u64) -> Result<Vec<(PathBuf, PathBuf)>, JoinError> {
    let mut moved = Vec::new();
    for path in reset_files(config) {
        let mut to = path.clone().into_os_string();
        to.push(format!(".reset-{now_ms}"));
        let to = PathBuf::from(to);
        std::fs::rename(&path, &to).map_err(|e| fail(format!("moving {} aside: {e}", path.display())))?;
        moved.push((path, to));
    }
    if let Some(first) = moved.first() {
        bc_core::keys::sync_dir_of(&first.0).map_err(|e| fail(e.to_string()))?;
    }
    Ok(moved)
}

/// Whether this machine has joined: its identity, checked.
pub fn already_joined(config: &Config) -> Result<Option<String>, JoinError> {
    Ok(load_identity(config).map_err(fail)?.map(|identity| {
        let i = identity.identity;
        format!("already joined as {} (tenant {}, pool {})", i.node_id, i.tenant_id, i.pool_id)
    }))
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_owned()).unwrap_or_default()
}

/// The GPUs the machine holds, claimed at join (the inventory after it is journaled).
fn claimed_gpus(config: &Config) -> Result<Vec<bc_proto::Gpu>, JoinError> {
    let source = crate::inventory::source(config.hardware.root.as_deref(), config.hardware.fake_seed).map_err(fail)?;
    Ok(source
        .read()
        .gpus
        .gpus
        .into_iter()
        .map(|g| bc_proto::Gpu {
            model: g.model,
            product: g.product,
            vram_gib: g.vram_gib,
            nvlink_domain: g.nvlink_domain,
            uuid: g.uuid,
        })
        .collect())
}

fn retryable(code: tonic::Code) -> bool {
    matches!(code, tonic::Code::Unavailable | tonic::Code::ResourceExhausted | tonic::Code::DeadlineExceeded)
}

/// The gateway's retry hint on a refusal, in milliseconds, if it gave one.
pub fn retry_hint_ms(status: &tonic::Status) -> Option<u64> {
    status.metadata().get(bc_proto::RETRY_PUSHBACK_MS_KEY)?.to_str().ok()?.parse().ok()
}

/// How long to wait before the next attempt: the back-off's delay, or the gateway's hint when
/// that is longer (bounded by `JOIN_PUSHBACK_MS_MAX`), so a gateway short of join permits is
/// not asked again before it said.
pub fn retry_delay_ms(hint_ms: Option<u64>, backoff_ms: u64) -> u64 {
    hint_ms.map_or(backoff_ms, |hint| hint.min(JOIN_PUSHBACK_MS_MAX).max(backoff_ms))
}

/// The node this machine joined as, if it has.
pub fn joined_node(config: &Config) -> Result<Option<String>, JoinError> {
    Ok(load_identity(config).map_err(fail)?.map(|identity| identity.identity.node_id))
}

/// Joins with `token` (as `node_id`, for a deployed machine's token bound to its node);
/// removes a token file once joined.
pub async fn join(config: &Config, token: Token, token_file: Option<&Path>, node_id: Option<&str>) -> Result<Outcome, JoinError> {
    join_sealed(config, token, token_file, node_id, None).await
}

/// [`join`], the token sealed to `seal_to` (the join encryption key of `join-encryption.jwk`)
/// when given: it then never leaves the machine in the clear, even inside the TLS session.
pub async fn join_sealed(
    config: &Config,
    token: Token,
    token_file: Option<&Path>,
    node_id: Option<&str>,
    seal_to: Option<&[u8; 32]>,
) -> Result<Outcome, JoinError> {
    join_with(config, token, token_file, &hostname(), node_id, seal_to).await
}

/// [`join`] under a given host name (`bcd sim`'s machines share one host but not one name).
pub async fn join_as(
    config: &Config,
    token: Token,
    token_file: Option<&Path>,
    hostname: &str,
    node_id: Option<&str>,
) -> Result<Outcome, JoinError> {
    join_with(config, token, token_file, hostname, node_id, None).await
}

async fn join_with(
    config: &Config,
    token: Token,
    token_file: Option<&Path>,
    hostname: &str,
    node_id: Option<&str>,
    seal_to: Option<&[u8; 32]>,
) -> Result<Outcome, JoinError> {
    let gateway = config.gateway().map_err(fail)?;
    let key = node_key_load_or_create(config).map_err(fail)?;
    let node_public_key = key.verifying_key().as_bytes().to_vec();
    let (plain, sealed_token) = match seal_to {
        None => (token.secret, None),
        Some(public) => {
            // The token's secrecy: from the OS's randomness, never a seed.
            #[allow(clippy::disallowed_methods)]
            let mut rng = rand::rng();
            let sealed = bc_core::well_known::seal_join_token(public, token.secret.as_bytes(), &node_public_key, &mut rng)
                .map_err(fail)?;
            let key_pin = bc_core::well_known::encryption_pin(public);
            (String::new(), Some(bc_proto::SealedJoinToken { enc: sealed.enc, ciphertext: sealed.ciphertext, key_pin }))
        }
    };
    let request = bc_proto::JoinRequest {
        token: plain,
        node_public_key,
        hardware: Some(bc_proto::HardwareClaims { hostname: hostname.to_owned(), gpus: claimed_gpus(config)? }),
        agent_version: env!("CARGO_PKG_VERSION").to_owned(),
        node_id: node_id.unwrap_or_default().to_owned(),
        sealed_token,
    };
    let channel = gateway.channel().map_err(fail)?;
    let mut client = AgentClient::new(channel);
    let mut backoff = Backoff::default();
    let mut rng = SystemRng;
    let mut attempt = 0;
    let response = loop {
        attempt += 1;
        let mut call = tonic::Request::new(request.clone());
        call.set_timeout(Duration::from_millis(JOIN_TIMEOUT_MS));
        match client.join(call).await {
            Ok(response) => break response.into_inner(),
            Err(status) if retryable(status.code()) && attempt < JOIN_ATTEMPTS_MAX => {
                let delay = retry_delay_ms(retry_hint_ms(&status), backoff.next_delay_ms(&mut rng as &mut dyn Rng));
                tracing::warn!(attempt, code = ?status.code(), error = %status.message(), delay_ms = delay, "join failed; retrying");
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
            Err(status) => {
                let spent = if attempt > 1 && status.code() == tonic::Code::PermissionDenied {
                    " (an earlier attempt may have joined: check `nodes list`, or join again with bcd join --reset --yes and a new token)"
                } else {
                    ""
                };
                return Err(fail(format!("join refused: {}{spent}", status.message())));
            }
        }
    };
    let message = keep_joined(config, &key, response)?;
    if token.source == Source::File
        && let Some(path) = token_file
    {
        remove_token_file(path);
    }
    Ok(Outcome::Joined(message))
}

/// Why one `TpmJoin` call failed: the gateway's status (retried when worth it, as a token
/// join's), or the machine's own TPM (never retried).
enum TpmCallFailure {
    Gateway(tonic::Status),
    Tpm(String),
}

/// `bcd join --attestor tpm`: joins with the machine's TPM and no token. The hello (the EK
/// certificate, a new attestation key) is made once; each `TpmJoin` call answers the gateway's
/// challenges in order (`crate::tpm::TpmRounds`), and its answer is kept as a token join's is.
/// A call refused in a way worth retrying (the gateway unreachable, out of join permits) is made
/// again from its start, with the gateway's new nonces, at most `JOIN_ATTEMPTS_MAX` times.
pub async fn join_tpm(config: &Config, tpm: &mut dyn crate::tpm::Tpm) -> Result<Outcome, JoinError> {
    let gateway = config.gateway().map_err(fail)?;
    let key = node_key_load_or_create(config).map_err(fail)?;
    let hardware = bc_proto::HardwareClaims { hostname: hostname(), gpus: claimed_gpus(config)? };
    let hello = crate::tpm::TpmRounds::hello(
        tpm,
        key.verifying_key().as_bytes().to_vec(),
        hardware,
        env!("CARGO_PKG_VERSION").to_owned(),
    )
    .map_err(fail)?;
    let mut client = AgentClient::new(gateway.channel().map_err(fail)?);
    let mut backoff = Backoff::default();
    let mut rng = SystemRng;
    let mut attempt = 0;
    let response = loop {
        attempt += 1;
        match tpm_join_call(&mut client, tpm, &hello).await {
            Ok(response) => break response,
            Err(TpmCallFailure::Tpm(message)) => return Err(fail(message)),
            Err(TpmCallFailure::Gateway(status)) if retryable(status.code()) && attempt < JOIN_ATTEMPTS_MAX => {
                let delay = retry_delay_ms(retry_hint_ms(&status), backoff.next_delay_ms(&mut rng as &mut dyn Rng));
                tracing::warn!(attempt, code = ?status.code(), error = %status.message(), delay_ms = delay, "TPM join failed; retrying");
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
            // The gateway's refusal says "join refused: CODE: …" itself.
            Err(TpmCallFailure::Gateway(status)) if status.message().starts_with("join refused") => {
                return Err(fail(status.message()));
            }
            Err(TpmCallFailure::Gateway(status)) => return Err(fail(format!("join refused: {}", status.message()))),
        }
    };
    keep_joined(config, &key, response).map(Outcome::Joined)
}

/// One `TpmJoin` call: the hello, then an answer to each challenge, until the gateway answers
/// with the join (or ends the call).
async fn tpm_join_call(
    client: &mut AgentClient<tonic::transport::Channel>,
    tpm: &mut dyn crate::tpm::Tpm,
    hello: &bc_proto::TpmJoinHello,
) -> Result<bc_proto::JoinResponse, TpmCallFailure> {
    use bc_proto::tpm_join_message::Msg as ToGateway;
    use bc_proto::tpm_join_reply::Msg as FromGateway;
    let (outbound, to_send) = tokio::sync::mpsc::channel(2);
    let closed = || TpmCallFailure::Gateway(tonic::Status::unavailable("the gateway closed the TPM join"));
    outbound.send(bc_proto::TpmJoinMessage { msg: Some(ToGateway::Hello(hello.clone())) }).await.map_err(|_| closed())?;
    let mut call = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(to_send));
    // The rounds and the TPM's work, all in one call.
    call.set_timeout(Duration::from_millis(JOIN_TIMEOUT_MS * u64::from(crate::tpm::TPM_ROUNDS_MAX)));
    let mut replies = client.tpm_join(call).await.map_err(TpmCallFailure::Gateway)?.into_inner();
    let mut rounds = crate::tpm::TpmRounds::default();
    loop {
        let reply = replies.message().await.map_err(TpmCallFailure::Gateway)?.ok_or_else(closed)?;
        match reply.msg {
            Some(FromGateway::Challenge(challenge)) => {
                let answer = rounds.answer(tpm, &challenge).map_err(TpmCallFailure::Tpm)?;
                outbound.send(bc_proto::TpmJoinMessage { msg: Some(ToGateway::Answer(answer)) }).await.map_err(|_| closed())?;
            }
            Some(FromGateway::Joined(response)) => return Ok(response),
            None => return Err(TpmCallFailure::Gateway(tonic::Status::internal("the gateway sent an empty TPM join reply"))),
        }
    }
}

/// Checks the gateway's answer to a join against the pinned log key and the node's key, and
/// keeps it: the node certificate, then `identity.json`. What to print.
fn keep_joined(config: &Config, key: &ed25519_dalek::SigningKey, response: bc_proto::JoinResponse) -> Result<String, JoinError> {
    if let Some(pin) = &config.join_signing_key_pin {
        verify_join_signature(&response, pin).map_err(|e| fail(format!("the gateway's answer: {e}")))?;
    }
    let identity = String::from_utf8(response.identity).map_err(|_| fail("the gateway's identity is not UTF-8"))?;
    let file = IdentityFile {
        identity,
        signature: bc_core::agent::b64(&response.signature),
        log_public_key: bc_core::agent::b64(&response.log_public_key),
    };
    let checked = verify_identity(&file, &config.log_key_pin, &key.verifying_key())
        .map_err(|e| fail(format!("the gateway's answer: {e}")))?;
    // The node certificate first: a machine with an identity is joined, and must have it.
    let certificate = (!response.node_certificate.is_empty()).then(|| {
        crate::node_cert::NodeCertificateFile::new(
            &response.node_certificate,
            &response.node_ca_certificate,
            checked.joined_at_ms,
            response.node_certificate_not_after_ms,
        )
    });
    if let Some(certificate) = &certificate {
        certificate.store(&config.data_dir).map_err(fail)?;
    }
    let text = serde_json::to_string_pretty(&file).map_err(|e| fail(e.to_string()))?;
    bc_core::keys::write_new_file(&config.identity_path(), format!("{text}\n").as_bytes(), 0o600)
        .map_err(|e| fail(e.to_string()))?;
    let until = certificate
        .map_or(String::new(), |c| format!("; certificate valid until {}", bc_core::clock::rfc3339_ms(c.not_after_ms)));
    Ok(format!("joined as {} (tenant {}, pool {}){until}", checked.node_id, checked.tenant_id, checked.pool_id))
}

/// Checks a `JoinResponse`'s join signature: by a key whose pin is `pin` (the configuration's
/// `join_signing_key_pin`), over `bc_core::well_known::join_response_signing_message`.
pub fn verify_join_signature(response: &bc_proto::JoinResponse, pin: &str) -> Result<(), String> {
    if response.join_signature.is_empty() {
        return Err("JOIN_SIGNATURE: it is not signed by a join signing key (join_signing_key_pin is set)".into());
    }
    let public: [u8; 32] = response
        .join_signing_public_key
        .as_slice()
        .try_into()
        .map_err(|_| "JOIN_SIGNATURE: the join signing key is not 32 bytes")?;
    let signer = ed25519_dalek::VerifyingKey::from_bytes(&public)
        .map_err(|_| "JOIN_SIGNATURE: the join signing key is not an Ed25519 key")?;
    let actual = bc_core::well_known::signing_pin(&signer);
    if actual != pin {
        return Err(format!("PIN_MISMATCH: it is signed by the join signing key {actual}, not join_signing_key_pin {pin}"));
    }
    let signature = ed25519_dalek::Signature::from_slice(&response.join_signature)
        .map_err(|_| "JOIN_SIGNATURE: the join signature is not 64 bytes")?;
    let message = signed_message(response);
    signer.verify_strict(&message, &signature).map_err(|_| "JOIN_SIGNATURE: the join signature does not verify".to_owned())
}

/// `bcd join --request`: asks to join with no token and waits for an operator's decision,
/// asking again as [`crate::join_request::AskWait`] says; joins once approved. `pending` is
/// told the request's id the first time it is pending.
pub async fn request(config: &Config, pending: impl Fn(&str)) -> Result<Outcome, JoinError> {
    use crate::join_request::{AskWait, Heard, Next};
    use bc_core::clock::{Clock, SystemClock};
    use ed25519_dalek::Signer;

    let gateway = config.gateway().map_err(fail)?;
    let key = node_key_load_or_create(config).map_err(fail)?;
    let public_key = key.verifying_key().as_bytes().to_vec();
    let mut signed = bc_proto::JOIN_ASK_SIGNING_PREFIX.to_vec();
    signed.extend_from_slice(&public_key);
    let ask = bc_proto::JoinAsk {
        node_public_key: public_key,
        hardware: Some(bc_proto::HardwareClaims { hostname: hostname(), gpus: claimed_gpus(config)? }),
        agent_version: env!("CARGO_PKG_VERSION").to_owned(),
        signature: key.sign(&signed).to_bytes().to_vec(),
    };
    let mut client = AgentClient::new(gateway.channel().map_err(fail)?);
    let mut wait = AskWait::new(SystemClock.now_ms());
    let mut rng = SystemRng;
    let mut told = false;
    loop {
        let mut call = tonic::Request::new(ask.clone());
        call.set_timeout(Duration::from_millis(JOIN_TIMEOUT_MS));
        let (heard, joined) = match client.request_join(call).await {
            Ok(answer) => {
                let answer = answer.into_inner();
                wait.named(&answer.join_request_id);
                match answer.state.as_str() {
                    bc_proto::JOIN_ASK_PENDING => {
                        if !told {
                            pending(&answer.join_request_id);
                            told = true;
                        }
                        (Heard::Pending { retry_after_ms: answer.retry_after_ms }, None)
                    }
                    bc_proto::JOIN_ASK_REJECTED => (Heard::Rejected { reason: answer.reason }, None),
                    bc_proto::JOIN_ASK_APPROVED => match answer.joined {
                        Some(joined) => (Heard::Approved, Some(joined)),
                        None => (Heard::Refused { message: "the gateway approved the request without the join".into() }, None),
                    },
                    other => (Heard::Refused { message: format!("the gateway answered with the unknown state {other:?}") }, None),
                }
            }
            Err(status) if retryable(status.code()) => {
                (Heard::Retryable { hint_ms: retry_hint_ms(&status), message: status.message().to_owned() }, None)
            }
            Err(status) => (Heard::Refused { message: status.message().to_owned() }, None),
        };
        match wait.next(SystemClock.now_ms(), heard, &mut rng as &mut dyn Rng) {
            Next::Join => {
                let joined = joined.ok_or_else(|| fail("an approval without its join"))?;
                return keep_joined(config, &key, joined).map(Outcome::Joined);
            }
            Next::Fail(message) => return Err(fail(message)),
            Next::AskAfter { delay_ms } => {
                tracing::debug!(delay_ms, "the join request is pending; asking again");
                tokio::time::sleep(Duration::from_millis(delay_ms)).await;
            }
        }
    }
}

/// Removes a spent token file; a read-only mount only warns.
pub fn remove_token_file(path: &Path) {
    if let Err(e) = std::fs::remove_file(path) {
        tracing::warn!(path = %path.display(), error = %e, "could not remove the token file");
    }
}

/// The bytes a `JoinResponse`'s join signature covers: its fields in
/// `bc_core::well_known::join_response_signing_message`'s frame.
fn signed_message(response: &bc_proto::JoinResponse) -> Vec<u8> {
    bc_core::well_known::join_response_signing_message(
        &response.identity,
        &response.signature,
        &response.log_public_key,
        &response.node_certificate,
        &response.node_ca_certificate,
        response.node_certificate_not_after_ms,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `JoinResponse` signed as the gateway signs it (`bc_gateway::agents`), by `key`.
    fn signed_response(key: &ed25519_dalek::SigningKey) -> bc_proto::JoinResponse {
        use ed25519_dalek::Signer;
        let mut response = bc_proto::JoinResponse {
            identity: b"{\"nodeId\":\"node_x\"}".to_vec(),
            signature: vec![1; 64],
            log_public_key: vec![2; 32],
            node_certificate: vec![3; 10],
            node_ca_certificate: vec![4; 10],
            node_certificate_not_after_ms: 5,
            ..Default::default()
        };
        let message = signed_message(&response);
        response.join_signature = key.sign(&message).to_bytes().to_vec();
        response.join_signing_public_key = key.verifying_key().to_bytes().to_vec();
        response
    }

    #[test]
    fn a_join_response_is_taken_only_signed_by_the_pinned_join_signing_key() {
        let key = ed25519_dalek::SigningKey::from_bytes(&[1; 32]);
        let pin = bc_core::well_known::signing_pin(&key.verifying_key());
        verify_join_signature(&signed_response(&key), &pin).unwrap();
        // Signed by another key: its pin is not the one held.
        let other = ed25519_dalek::SigningKey::from_bytes(&[2; 32]);
        assert!(verify_join_signature(&signed_response(&other), &pin).unwrap_err().starts_with("PIN_MISMATCH"));
        // Any field changed after signing: the signature no longer verifies.
        for change in [
            |r: &mut bc_proto::JoinResponse| r.identity.push(b' '),
            |r: &mut bc_proto::JoinResponse| r.node_certificate[0] ^= 1,
            |r: &mut bc_proto::JoinResponse| r.node_certificate_not_after_ms += 1,
            |r: &mut bc_proto::JoinResponse| r.join_signature[0] ^= 1,
        ] {
            let mut response = signed_response(&key);
            change(&mut response);
            assert!(verify_join_signature(&response, &pin).unwrap_err().starts_with("JOIN_SIGNATURE"));
        }
        // Not signed at all (a gateway without join keys) while a pin is held.
        let mut unsigned = signed_response(&key);
        unsigned.join_signature.clear();
        assert!(verify_join_signature(&unsigned, &pin).unwrap_err().starts_with("JOIN_SIGNATURE"));
    }

    #[test]
    fn a_join_waits_at_least_the_gateways_hint_and_no_longer_than_the_bound() {
        assert_eq!(retry_delay_ms(None, 700), 700);
        assert_eq!(retry_delay_ms(Some(1_000), 700), 1_000, "the hint when it is longer");
        assert_eq!(retry_delay_ms(Some(200), 700), 700, "the back-off when it is longer");
        assert_eq!(retry_delay_ms(Some(u64::MAX), 700), JOIN_PUSHBACK_MS_MAX);
        let mut status = tonic::Status::unavailable("busy");
        assert_eq!(retry_hint_ms(&status), None);
        status.metadata_mut().insert(bc_proto::RETRY_PUSHBACK_MS_KEY, 1_500u64.into());
        assert_eq!(retry_hint_ms(&status), Some(1_500));
        status.metadata_mut().insert(bc_proto::RETRY_PUSHBACK_MS_KEY, tonic::metadata::MetadataValue::from_static("soon"));
        assert_eq!(retry_hint_ms(&status), None, "a hint that is not a number is ignored");
    }
}
