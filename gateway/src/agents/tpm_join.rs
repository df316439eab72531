//! `TpmJoin`: a machine joins with its TPM and no token (`bcd join --attestor tpm`,
//! docs/admission.md). Every check is `crate::tpm`'s, pure; this module carries the rounds over
//! the call's stream and appends the join.
//!
//! 1. `hello`: the EK certificate chain is checked against the deployment's EK CA bundle
//!    (`--tpm-ek-ca-bundle`) and the AK's public area parsed, before anything is made for it.
//! 2. Round 1's challenge: a credential made for that EK and the AK's name
//!    (`tpm::make_credential`), and the qualifying data to quote (a fresh nonce and the node's
//!    key). The answer gives the credential back (so the AK is in that EK's TPM) and a quote by
//!    the AK over `tpm::QUOTED_PCRS` with that qualifying data. When its PCR values are not
//!    those its digest covers (a PCR extended between the read and the quote), the next round
//!    asks again with a new nonce, at most `tpm::CHALLENGE_ROUNDS_MAX` rounds in all.
//! 3. `node.joined` (actor `tpm:<EK pin>`, `joinTokenId` empty, `tpm` the evidence) and its
//!    `node.certificate_issued`, as the first append of the node the EK names
//!    (`tpm::node_id_of`), in the pool `--tpm-join-pool` names, guarded on that pool: a TPM that
//!    joined before finds its node's stream there and is refused `TPM_ALREADY_JOINED`, never
//!    made a second node.
//!
//! Bounds: the call holds one of the endpoint's join permits for its life; each message from the
//! machine comes within [`TPM_MESSAGE_TIMEOUT_MS`] or the join ends; the nonces and the
//! credential live only in this call (a quote from another call is refused `TPM_QUOTE_NONCE`).

use std::path::Path;
use std::time::Duration;

use bc_core::agent::{b64, node_public_key};
use bc_core::id::{PoolId, TenantId};
use bc_core::store::{AppendRequest, ExpectedVersion, NewEvent};
use bc_core::{Error, Result};
use bc_projections::events as ev;
use bc_projections::{KIND_NODE, KIND_POOL, PoolDoc, stream_of};
use bc_proto::tpm_join_message::Msg as FromMachine;
use bc_proto::tpm_join_reply::Msg as ToMachine;
use futures::{Stream, StreamExt};

use super::join::{
    AGENT_VERSION_BYTES_MAX, HOSTNAME_BYTES_MAX, Joined, check_text, gpus_of, node_name, refused, signed_identity,
};
use crate::AppState;
use crate::tpm::{self, AkPublic, EkCaBundle, TpmRefusal};

/// Each message of a TPM join from the machine must come within this of the last one sent (a
/// TPM answers a quote in well under a second; swtpm in milliseconds).
pub const TPM_MESSAGE_TIMEOUT_MS: u64 = 10_000;
/// Appends decided again when another join of the pool moved it first.
const ADMIT_ATTEMPTS_MAX: usize = 3;

/// What TPM joins need (`--tpm-ek-ca-bundle`, `--tpm-join-pool`): without them `TpmJoin` is
/// refused `TPM_NOT_CONFIGURED`.
#[derive(Clone, Debug)]
pub struct TpmJoins {
    /// The certificates an EK certificate must chain to.
    pub bundle: EkCaBundle,
    /// The pool every TPM-attested machine joins (its tenant found from its row).
    pub pool_id: PoolId,
}

impl TpmJoins {
    /// Reads the EK CA bundle at `path` (PEM, at most `tpm::EK_CA_BUNDLE_BYTES_MAX`).
    pub fn load(path: &Path, pool_id: PoolId) -> std::result::Result<Self, String> {
        let size = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?.len();
        if size > tpm::EK_CA_BUNDLE_BYTES_MAX as u64 {
            return Err(format!("{}: an EK CA bundle is at most {} bytes", path.display(), tpm::EK_CA_BUNDLE_BYTES_MAX));
        }
        let pem = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let bundle = EkCaBundle::from_pem(&pem).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Self { bundle, pool_id })
    }
}

/// TPM joins in progress at once, each through its rounds (up to about 40 s): past them a join
/// is refused `UNAVAILABLE` with a retry hint. Apart from the shared join permits, which a TPM
/// join takes only for its append, so calls that send nothing never hold back token joins.
pub const TPM_JOINS_CONCURRENT_MAX: usize = 16;

/// A refusal of the TPM's evidence, as the machine is told it (`join refused: TPM_…: …`).
fn tpm_refused(refusal: TpmRefusal) -> Error {
    refused(&refusal.to_string())
}

/// The machine's next message, within [`TPM_MESSAGE_TIMEOUT_MS`].
async fn next_message<S>(inbound: &mut S) -> Result<FromMachine>
where
    S: Stream<Item = std::result::Result<bc_proto::TpmJoinMessage, tonic::Status>> + Unpin,
{
    let protocol = |message: String| tpm_refused(tpm::refusal("TPM_PROTOCOL", message));
    match tokio::time::timeout(Duration::from_millis(TPM_MESSAGE_TIMEOUT_MS), inbound.next()).await {
        Err(_) => Err(tpm_refused(tpm::refusal(
            "TPM_TIMEOUT",
            format!("a TPM join's message did not come within {TPM_MESSAGE_TIMEOUT_MS} ms"),
        ))),
        Ok(None) => Err(protocol("the machine ended the TPM join".into())),
        Ok(Some(Err(status))) => Err(protocol(format!("the machine's stream failed: {}", status.message()))),
        Ok(Some(Ok(message))) => message.msg.ok_or_else(|| protocol("an empty TPM join message".into())),
    }
}

/// The secrets of one join, drawn from the OS's randomness before the first round: the
/// credential, its wrapping, and a nonce per round.
struct Secrets {
    credential: [u8; tpm::CREDENTIAL_BYTES],
    made: tpm::MadeCredential,
    nonces: [[u8; tpm::NONCE_BYTES]; tpm::CHALLENGE_ROUNDS_MAX as usize],
}

fn secrets(ek: &tpm::VerifiedEk, ak: &AkPublic) -> std::result::Result<Secrets, TpmRefusal> {
    use rand::Rng as _;
    // What proves a TPM's possession of its EK: from the OS's randomness, never a seed.
    let mut rng = rand::rng();
    let mut credential = [0u8; tpm::CREDENTIAL_BYTES];
    rng.fill_bytes(&mut credential);
    let mut nonces = [[0u8; tpm::NONCE_BYTES]; tpm::CHALLENGE_ROUNDS_MAX as usize];
    for nonce in &mut nonces {
        rng.fill_bytes(nonce);
    }
    let made = tpm::make_credential(&ek.public, &ak.name, &credential, &mut rng)?;
    Ok(Secrets { credential, made, nonces })
}

/// One TPM join, from its `hello` to the append (under one of `appends`' permits): the joined
/// identity, or why not.
pub async fn run<S>(
    state: &AppState,
    appends: &tokio::sync::Semaphore,
    inbound: &mut S,
    outbound: &tokio::sync::mpsc::Sender<std::result::Result<bc_proto::TpmJoinReply, tonic::Status>>,
) -> Result<Joined>
where
    S: Stream<Item = std::result::Result<bc_proto::TpmJoinMessage, tonic::Status>> + Unpin,
{
    let joins = state.tpm_joins.as_ref().ok_or_else(|| {
        tpm_refused(tpm::refusal(
            "TPM_NOT_CONFIGURED",
            "this control plane takes no TPM joins (serve --tpm-ek-ca-bundle FILE --tpm-join-pool POOL): join with a token",
        ))
    })?;
    let FromMachine::Hello(hello) = next_message(inbound).await? else {
        return Err(tpm_refused(tpm::refusal("TPM_PROTOCOL", "a TPM join starts with hello")));
    };
    let public_key = node_public_key(&hello.node_public_key).map_err(Error::invalid)?;
    let hardware = hello.hardware.clone().unwrap_or_default();
    let (gpus, gpu_uuids) = gpus_of(&hardware.gpus)?;
    check_text("hostname", &hardware.hostname, HOSTNAME_BYTES_MAX)?;
    check_text("agent version", &hello.agent_version, AGENT_VERSION_BYTES_MAX)?;
    let now_s = (state.log.clock.now_ms() / 1000) as i64;
    let ek = joins.bundle.verify_chain(&hello.ek_certificates, now_s).map_err(tpm_refused)?;
    let ak = AkPublic::parse(&hello.ak_public).map_err(tpm_refused)?;
    let secrets = secrets(&ek, &ak).map_err(tpm_refused)?;
    let mut admitted = None;
    for round in 1..=tpm::CHALLENGE_ROUNDS_MAX {
        let qualifying = tpm::qualifying_data(&secrets.nonces[round as usize - 1], &hello.node_public_key);
        let first = round == 1;
        let challenge = bc_proto::TpmJoinChallenge {
            round,
            credential_blob: if first { secrets.made.credential_blob.clone() } else { Vec::new() },
            encrypted_secret: if first { secrets.made.encrypted_secret.clone() } else { Vec::new() },
            qualifying_data: qualifying.to_vec(),
            pcrs: tpm::QUOTED_PCRS.to_vec(),
        };
        outbound
            .send(Ok(bc_proto::TpmJoinReply { msg: Some(ToMachine::Challenge(challenge)) }))
            .await
            .map_err(|_| tpm_refused(tpm::refusal("TPM_PROTOCOL", "the machine left the TPM join")))?;
        let FromMachine::Answer(answer) = next_message(inbound).await? else {
            return Err(tpm_refused(tpm::refusal("TPM_PROTOCOL", "a TPM join's challenge is answered with answer")));
        };
        if first {
            tpm::check_credential(&secrets.credential, &answer.credential).map_err(tpm_refused)?;
        }
        match tpm::Quote::verify(&answer.quote, &answer.quote_signature, &ak, &qualifying, &answer.pcr_values) {
            Ok(_) => {
                admitted = Some((answer, qualifying));
                break;
            }
            Err(refusal) if refusal.code == "TPM_PCR_DIGEST" && round < tpm::CHALLENGE_ROUNDS_MAX => {
                tracing::debug!(round, "a TPM's PCRs moved between its read and its quote; asking again");
            }
            Err(refusal) if refusal.code == "TPM_PCR_DIGEST" => {
                return Err(tpm_refused(tpm::refusal(
                    "TPM_PCR_DIGEST",
                    format!("the PCR values sent were not those quoted in any of {} rounds", tpm::CHALLENGE_ROUNDS_MAX),
                )));
            }
            Err(refusal) => return Err(tpm_refused(refusal)),
        }
    }
    let (answer, qualifying) =
        admitted.ok_or_else(|| Error::Internal("the TPM join's rounds ended with no quote taken".into()))?;
    let evidence = ev::TpmEvidence {
        ek_pin: ek.pin.clone(),
        ek_certificates: hello.ek_certificates.iter().map(|c| b64(c)).collect(),
        ak_public: b64(&hello.ak_public),
        quote: b64(&answer.quote),
        quote_signature: b64(&answer.quote_signature),
        qualifying_data: b64(&qualifying),
        pcrs: tpm::QUOTED_PCRS.to_vec(),
        pcr_values: answer.pcr_values.iter().map(hex::encode).collect(),
    };
    let joined = ev::NodeJoined {
        pool_id: joins.pool_id.to_string(),
        name: node_name(&hardware.hostname),
        gpus,
        labels: Default::default(),
        public_key: b64(public_key.as_bytes()),
        join_token_id: String::new(),
        agent_version: hello.agent_version.clone(),
        hostname: hardware.hostname.clone(),
        gpu_uuids,
        tpm: Some(evidence),
    };
    let _permit = appends.acquire().await.map_err(|_| Error::Internal("the join permits were closed".into()))?;
    admit(state, joins.pool_id, &ek, joined, &public_key).await
}

/// Appends the join as the first events of the node the EK names, guarded on the pool.
async fn admit(
    state: &AppState,
    pool_id: PoolId,
    ek: &tpm::VerifiedEk,
    joined: ev::NodeJoined,
    public_key: &ed25519_dalek::VerifyingKey,
) -> Result<Joined> {
    let node = tpm::node_id_of(&ek.spki_der);
    let actor = format!("tpm:{}", ek.pin);
    for _ in 0..ADMIT_ATTEMPTS_MAX {
        let pool_row = state.store.row_find(KIND_POOL, &pool_id.to_string()).await?;
        let pool_row = pool_row.ok_or_else(|| {
            tpm_refused(tpm::refusal("TPM_NOT_CONFIGURED", format!("the TPM joins' pool {pool_id} does not exist")))
        })?;
        let tenant: TenantId = pool_row.key.tenant.parse()?;
        let pool: PoolDoc = crate::api::call::doc(pool_row)?;
        if pool.archived {
            return Err(tpm_refused(tpm::refusal("TPM_NOT_CONFIGURED", format!("the TPM joins' pool {pool_id} is archived"))));
        }
        let node_stream = stream_of(KIND_NODE, &node);
        // The node's stream in the joins' tenant (it outlives the node's deletion), and its row in
        // any tenant (the joins' pool may have been another tenant's when this TPM joined).
        if !state.store.read_stream_rows(tenant, &node_stream, 0, 1).await?.is_empty()
            || state.store.row_find(KIND_NODE, &node.to_string()).await?.is_some()
        {
            return Err(already_joined(node));
        }
        let nodes = state.fleet.with_tenant(&*state.store, tenant, |view| view.nodes().len()).await?;
        bc_projections::decide::node_register(nodes)?;
        let certificate = super::join::issue_node_certificate(state, node, public_key)?;
        let mut events = vec![NewEvent::new(ev::NODE_JOINED, ev::to_cbor(&joined)?)];
        events.extend(certificate.as_ref().map(|c| c.event(false)).transpose()?);
        let mut request = AppendRequest::new(tenant, node_stream, ExpectedVersion::NoStream, actor.clone(), events);
        request.guards = vec![(stream_of(KIND_POOL, &pool_id), ExpectedVersion::Exact(pool.version))];
        match state.log.append(request).await {
            Ok(result) => {
                let mut answer = signed_identity(state, tenant, node, pool_id, public_key, &result.events[0]).await?;
                answer.certificate = certificate;
                tracing::info!(%tenant, node = %node, ek = %ek.pin, "a machine joined by its TPM");
                return Ok(answer);
            }
            // The node's stream appeared (a racing join of the same TPM) or the pool moved:
            // read again.
            Err(Error::Conflict { .. }) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(Error::Unavailable("the TPM join is contended; retry".into()))
}

fn already_joined(node: bc_core::id::NodeId) -> Error {
    tpm_refused(tpm::refusal(
        "TPM_ALREADY_JOINED",
        format!("this TPM already joined as node {node}: a TPM names one node, never a second, even once that node is deleted"),
    ))
}
