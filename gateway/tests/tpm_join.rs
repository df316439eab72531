//! The rounds of `TpmJoin` in process (docs/admission.md, "TPM joins"), the machine played by the
//! unit tests' software TPM (`src/tpm/soft_tpm.rs`): a quote whose PCR values moved is asked again
//! in round 2 with a new nonce and no credential, and the join takes round 2's quote; PCR values
//! that never match are refused after the third round; a credential not given back is refused;
//! a machine that hangs up after its hello joins nothing; a gateway without an EK CA bundle
//! refuses; and the same EK with another node key is refused `TPM_ALREADY_JOINED`. The
//! swtpm end-to-end test (`tests/tests/tpm_join.rs`) shows the same against a real TPM.

use crate::common;

#[path = "../src/tpm/soft_tpm.rs"]
mod soft_tpm;

use std::sync::Arc;

use bc_gateway::AppState;
use bc_gateway::agents::join::Joined;
use bc_gateway::agents::tpm_join::{self, TpmJoins};
use bc_gateway::tpm as tpm_api;
use bc_proto::tpm_join_message::Msg as ToGateway;
use bc_proto::tpm_join_reply::Msg as FromGateway;
use futures::StreamExt;
use serde_json::json;
use soft_tpm::{CA, EK_CERT, SoftTpm, der};

fn node_public_key(seed: u8) -> Vec<u8> {
    ed25519_dalek::SigningKey::from_bytes(&[seed; 32]).verifying_key().to_bytes().to_vec()
}

/// A state taking TPM joins into a new pool (or none, `configured` false).
async fn setup(dir: &std::path::Path, configured: bool) -> Arc<AppState> {
    let log = common::sqlite_log(dir).await;
    let admin = common::admin_token(&log).await;
    let router = bc_gateway::router(Arc::new(AppState::new(log.clone())));
    let (status, pool) = common::call(&router, &admin, "pools.create", json!({ "name": "tpm" })).await;
    assert_eq!(status, 200, "{pool}");
    let joins = configured.then(|| TpmJoins {
        bundle: tpm_api::EkCaBundle::from_pem(CA.as_bytes()).unwrap(),
        pool_id: pool["poolId"].as_str().unwrap().parse().unwrap(),
    });
    Arc::new(AppState::new(log).with_tpm_joins(joins))
}

/// How the machine answers round `round` (1, 2, 3): the PCR values it sends (`None`: those it
/// quoted), the credential (`None`: the one its TPM gave back), or hang up (`hang_up`).
#[derive(Clone, Default)]
struct Machine {
    node_seed: u8,
    moved_in_rounds: Vec<u32>,
    wrong_credential: bool,
    hang_up: bool,
}

/// What one join saw: each challenge, and the gateway's end (the joined identity or the error).
struct Outcome {
    challenges: Vec<bc_proto::TpmJoinChallenge>,
    result: Result<Joined, String>,
}

async fn join(state: &AppState, machine: Machine) -> Outcome {
    let tpm = SoftTpm::new();
    let ak_public = tpm.ak_public();
    let ak = tpm_api::AkPublic::parse(&ak_public).unwrap();
    let (to_gateway, from_machine) = tokio::sync::mpsc::channel(4);
    let mut inbound = tokio_stream::wrappers::ReceiverStream::new(from_machine).map(Ok);
    let (outbound, mut replies) = tokio::sync::mpsc::channel::<Result<bc_proto::TpmJoinReply, tonic::Status>>(2);
    let hello = bc_proto::TpmJoinHello {
        node_public_key: node_public_key(machine.node_seed),
        hardware: Some(bc_proto::HardwareClaims { hostname: "tpm-host".into(), gpus: vec![] }),
        agent_version: "0.1.0".into(),
        ek_certificates: vec![der(EK_CERT)],
        ak_public,
    };
    to_gateway.send(bc_proto::TpmJoinMessage { msg: Some(ToGateway::Hello(hello)) }).await.unwrap();
    let answering = async {
        let mut challenges = Vec::new();
        while let Some(Ok(reply)) = replies.recv().await {
            let Some(FromGateway::Challenge(challenge)) = reply.msg else { break };
            challenges.push(challenge.clone());
            if machine.hang_up {
                break;
            }
            let credential = if challenge.round == 1 {
                let made = tpm_api::MadeCredential {
                    credential_blob: challenge.credential_blob.clone(),
                    encrypted_secret: challenge.encrypted_secret.clone(),
                };
                let mut credential = tpm.activate(&made, &ak.name).unwrap();
                if machine.wrong_credential {
                    credential[0] ^= 1;
                }
                credential
            } else {
                Vec::new()
            };
            let (quote, quote_signature) = tpm.quote(&challenge.qualifying_data);
            let mut pcr_values = tpm.pcrs.clone();
            if machine.moved_in_rounds.contains(&challenge.round) {
                pcr_values[7][0] ^= 1; // PCR 7 extended after the quote
            }
            let answer = bc_proto::TpmJoinAnswer { credential, quote, quote_signature, pcr_values };
            if to_gateway.send(bc_proto::TpmJoinMessage { msg: Some(ToGateway::Answer(answer)) }).await.is_err() {
                break;
            }
        }
        drop(to_gateway);
        challenges
    };
    let (challenges, result) = tokio::join!(answering, async {
        let result = tpm_join::run(state, &tokio::sync::Semaphore::new(1), &mut inbound, &outbound).await;
        drop(outbound);
        result
    });
    Outcome { challenges, result: result.map_err(|e| e.public_message()) }
}

#[tokio::test]
async fn a_quote_whose_pcrs_moved_is_asked_again_and_the_join_takes_the_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let state = setup(dir.path(), true).await;
    let outcome = join(&state, Machine { node_seed: 1, moved_in_rounds: vec![1], ..Default::default() }).await;
    let joined = outcome.result.expect("joined in round 2");
    let rounds: Vec<u32> = outcome.challenges.iter().map(|c| c.round).collect();
    assert_eq!(rounds, [1, 2]);
    let (first, second) = (&outcome.challenges[0], &outcome.challenges[1]);
    assert!(!first.credential_blob.is_empty() && !first.encrypted_secret.is_empty());
    assert!(second.credential_blob.is_empty() && second.encrypted_secret.is_empty(), "the credential is made once");
    assert_ne!(first.qualifying_data, second.qualifying_data, "each round its own nonce");
    assert_eq!(first.pcrs, tpm_api::QUOTED_PCRS);
    // The event holds round 2's quote and qualifying data.
    let identity: serde_json::Value = serde_json::from_slice(&joined.identity).unwrap();
    let node = identity["nodeId"].as_str().unwrap();
    let ek = tpm_api::EkCaBundle::from_pem(CA.as_bytes()).unwrap().verify_chain(&[der(EK_CERT)], 1_796_688_000).unwrap();
    assert_eq!(node, tpm_api::node_id_of(&ek.spki_der).to_string(), "the EK names the node");
    let tenant = identity["tenantId"].as_str().unwrap().parse().unwrap();
    let rows = state.store.read_stream_rows(tenant, &format!("node/{node}"), 0, 10).await.unwrap();
    let event = rows[0].clone().decode().unwrap();
    assert_eq!((event.envelope.event_type.as_str(), event.envelope.actor.clone()), ("node.joined", format!("tpm:{}", ek.pin)));
    let payload = bc_core::canonical::to_json(&event.envelope.payload);
    use base64::Engine as _;
    let qualifying =
        base64::engine::general_purpose::STANDARD.decode(payload["tpm"]["qualifyingData"].as_str().unwrap()).unwrap();
    assert_eq!(qualifying, second.qualifying_data, "round 2's quote is the one kept");
    assert_eq!(payload["tpm"]["ekPin"], ek.pin.as_str());
    assert_eq!(payload["joinTokenId"], "");

    // The same EK again, with another node key: refused, naming the node; no second node.
    let again = join(&state, Machine { node_seed: 2, ..Default::default() }).await;
    let refused = again.result.err().expect("the same TPM again");
    assert!(refused.contains("TPM_ALREADY_JOINED") && refused.contains(node), "{refused}");
    assert_eq!(state.store.read_stream_rows(tenant, &format!("node/{node}"), 0, 10).await.unwrap().len(), rows.len());
}

#[tokio::test]
async fn pcrs_that_never_match_credentials_not_given_back_and_hang_ups_join_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let state = setup(dir.path(), true).await;
    let never = join(&state, Machine { node_seed: 1, moved_in_rounds: vec![1, 2, 3], ..Default::default() }).await;
    assert_eq!(never.challenges.len(), tpm_api::CHALLENGE_ROUNDS_MAX as usize, "three rounds, no fourth");
    let refused = never.result.err().expect("never matched");
    assert!(refused.contains("TPM_PCR_DIGEST") && refused.contains("3 rounds"), "{refused}");

    let wrong = join(&state, Machine { node_seed: 1, wrong_credential: true, ..Default::default() }).await;
    assert!(wrong.result.err().expect("another credential").contains("TPM_CREDENTIAL"));

    let gone = join(&state, Machine { node_seed: 1, hang_up: true, ..Default::default() }).await;
    assert_eq!(gone.challenges.len(), 1);
    assert!(gone.result.is_err());

    // None of them made the node: a join now succeeds.
    join(&state, Machine { node_seed: 1, ..Default::default() }).await.result.expect("a good join after the refusals");

    let other_dir = tempfile::tempdir().unwrap();
    let unconfigured = setup(other_dir.path(), false).await;
    let refused = join(&unconfigured, Machine::default()).await.result.err().expect("no bundle");
    assert!(refused.contains("TPM_NOT_CONFIGURED"), "{refused}");
}
