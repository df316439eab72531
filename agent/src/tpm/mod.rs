//! `bcd join --attestor tpm`: the machine's TPM proves who it is, with no token
//! (docs/admission.md). The TPM is reached only through the [`Tpm`] trait, so the rounds'
//! logic here ([`TpmRounds`]) does no IO of its own and is tested against a fake; `join.rs`
//! carries the messages over the agents' endpoint.
//!
//! - [`Tpm`]: the EK certificate from the TPM's NV, an attestation key made under the EK,
//!   TPM2_ActivateCredential, TPM2_Quote and the PCR values. [`esapi::EsapiTpm`] (feature
//!   `tpm`, Debian's `libtss2-dev`) is the real one, over a TCTI: `device:/dev/tpmrm0` unless
//!   `BCD_TPM_TCTI` names another (`swtpm:host=127.0.0.1,port=2321` for swtpm).
//! - [`TpmRounds`]: the hello, then each challenge answered in order, at most
//!   [`TPM_ROUNDS_MAX`]: round 1 activates the credential and quotes; a later round (the
//!   gateway saw PCRs move between the read and the quote) quotes again with its new nonce.
//!
//! In fakehw builds, `BCD_TPM_QUOTE_RECORD=FILE` writes each quote made to FILE and
//! `BCD_TPM_QUOTE_REPLAY=FILE` answers with FILE's quote instead of a fresh one (the replay the
//! end-to-end test shows refused): [`Replaying`].

#[cfg(feature = "tpm")]
pub mod esapi;

/// Challenge rounds a join answers (the gateway's `tpm::CHALLENGE_ROUNDS_MAX`).
pub const TPM_ROUNDS_MAX: u32 = 3;
/// PCRs a challenge may ask for (a TPM has 24 in a bank).
pub const PCRS_MAX: usize = 24;
/// The TCTI `bcd join --attestor tpm` uses when `BCD_TPM_TCTI` names none: the kernel's
/// resource manager.
pub const TCTI_DEFAULT: &str = "device:/dev/tpmrm0";
/// The environment variable naming another TCTI.
pub const TCTI_ENV: &str = "BCD_TPM_TCTI";

/// A quote made by the TPM: its `TPMS_ATTEST`, its `TPMT_SIGNATURE`, and the values of the PCRs
/// quoted, in the order asked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TpmQuote {
    pub attest: Vec<u8>,
    pub signature: Vec<u8>,
    pub pcr_values: Vec<Vec<u8>>,
}

/// The machine's TPM, as a join uses it. Errors are said in words for `bcd join` to print.
pub trait Tpm {
    /// The EK certificate (DER), then any intermediates, leaf first.
    fn ek_certificates(&mut self) -> Result<Vec<Vec<u8>>, String>;
    /// Makes an attestation key under the EK (kept loaded for the join) and gives its
    /// `TPMT_PUBLIC`.
    fn ak_public(&mut self) -> Result<Vec<u8>, String>;
    /// TPM2_ActivateCredential with the AK and the EK: the credential, if it was made for them.
    fn activate_credential(&mut self, credential_blob: &[u8], encrypted_secret: &[u8]) -> Result<Vec<u8>, String>;
    /// TPM2_Quote by the AK over `pcrs` of the SHA-256 bank with `qualifying_data`, and their
    /// values.
    fn quote(&mut self, qualifying_data: &[u8], pcrs: &[u32]) -> Result<TpmQuote, String>;
}

/// The rounds of one TPM join, in order.
#[derive(Debug, Default)]
pub struct TpmRounds {
    /// The last round answered (0: none yet).
    answered: u32,
}

impl TpmRounds {
    /// The join's first message: the node's key and claims, the EK certificates, a new AK.
    pub fn hello(
        tpm: &mut dyn Tpm,
        node_public_key: Vec<u8>,
        hardware: bc_proto::HardwareClaims,
        agent_version: String,
    ) -> Result<bc_proto::TpmJoinHello, String> {
        let ek_certificates = tpm.ek_certificates()?;
        if ek_certificates.is_empty() {
            return Err("the TPM holds no EK certificate".into());
        }
        let ak_public = tpm.ak_public()?;
        Ok(bc_proto::TpmJoinHello { node_public_key, hardware: Some(hardware), agent_version, ek_certificates, ak_public })
    }

    /// The answer to `challenge`, which must be the next round: the first carries the
    /// credential, the later ones none.
    pub fn answer(
        &mut self,
        tpm: &mut dyn Tpm,
        challenge: &bc_proto::TpmJoinChallenge,
    ) -> Result<bc_proto::TpmJoinAnswer, String> {
        if challenge.round != self.answered + 1 || challenge.round > TPM_ROUNDS_MAX {
            return Err(format!(
                "the gateway asked round {} after round {} (at most {TPM_ROUNDS_MAX})",
                challenge.round, self.answered
            ));
        }
        let first = challenge.round == 1;
        let has_credential = !challenge.credential_blob.is_empty() && !challenge.encrypted_secret.is_empty();
        if first != has_credential {
            return Err(format!(
                "round {} of the gateway's challenge {} a credential",
                challenge.round,
                if first { "lacks" } else { "carries" }
            ));
        }
        if challenge.qualifying_data.len() != 32 {
            return Err("the gateway's qualifying data is not 32 bytes".into());
        }
        if challenge.pcrs.is_empty() || challenge.pcrs.len() > PCRS_MAX || challenge.pcrs.iter().any(|p| *p as usize >= PCRS_MAX)
        {
            return Err(format!("the gateway asked for PCRs {:?} (1 to {PCRS_MAX} of 0 to {})", challenge.pcrs, PCRS_MAX - 1));
        }
        let credential =
            if first { tpm.activate_credential(&challenge.credential_blob, &challenge.encrypted_secret)? } else { Vec::new() };
        let quote = tpm.quote(&challenge.qualifying_data, &challenge.pcrs)?;
        self.answered = challenge.round;
        Ok(bc_proto::TpmJoinAnswer {
            credential,
            quote: quote.attest,
            quote_signature: quote.signature,
            pcr_values: quote.pcr_values,
        })
    }
}

/// A TPM whose quotes are recorded to a file, or replaced by a recorded one (fakehw builds:
/// `BCD_TPM_QUOTE_RECORD`, `BCD_TPM_QUOTE_REPLAY`), everything else the inner TPM's.
#[cfg(feature = "fakehw")]
pub struct Replaying<T> {
    pub inner: T,
    pub record: Option<std::path::PathBuf>,
    pub replay: Option<std::path::PathBuf>,
}

#[cfg(feature = "fakehw")]
impl<T: Tpm> Tpm for Replaying<T> {
    fn ek_certificates(&mut self) -> Result<Vec<Vec<u8>>, String> {
        self.inner.ek_certificates()
    }

    fn ak_public(&mut self) -> Result<Vec<u8>, String> {
        self.inner.ak_public()
    }

    fn activate_credential(&mut self, credential_blob: &[u8], encrypted_secret: &[u8]) -> Result<Vec<u8>, String> {
        self.inner.activate_credential(credential_blob, encrypted_secret)
    }

    fn quote(&mut self, qualifying_data: &[u8], pcrs: &[u32]) -> Result<TpmQuote, String> {
        use base64::Engine as _;
        let b64 = base64::engine::general_purpose::STANDARD;
        if let Some(path) = &self.replay {
            let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
            let recorded: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
            let field = |name: &str| -> Result<Vec<u8>, String> {
                b64.decode(recorded[name].as_str().unwrap_or_default()).map_err(|e| format!("{}: {name}: {e}", path.display()))
            };
            let pcr_values = recorded["pcrValues"]
                .as_array()
                .map(|values| values.iter().map(|v| b64.decode(v.as_str().unwrap_or_default()).unwrap_or_default()).collect())
                .unwrap_or_default();
            return Ok(TpmQuote { attest: field("attest")?, signature: field("signature")?, pcr_values });
        }
        let quote = self.inner.quote(qualifying_data, pcrs)?;
        if let Some(path) = &self.record {
            let recorded = serde_json::json!({
                "attest": b64.encode(&quote.attest),
                "signature": b64.encode(&quote.signature),
                "pcrValues": quote.pcr_values.iter().map(|v| b64.encode(v)).collect::<Vec<_>>(),
            });
            std::fs::write(path, recorded.to_string()).map_err(|e| format!("{}: {e}", path.display()))?;
        }
        Ok(quote)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A TPM that answers with fixed bytes and counts what it was asked.
    #[derive(Default)]
    struct FakeTpm {
        activations: u32,
        quotes: Vec<Vec<u8>>,
    }

    impl Tpm for FakeTpm {
        fn ek_certificates(&mut self) -> Result<Vec<Vec<u8>>, String> {
            Ok(vec![vec![0x30, 1]])
        }
        fn ak_public(&mut self) -> Result<Vec<u8>, String> {
            Ok(vec![0, 1])
        }
        fn activate_credential(&mut self, blob: &[u8], _secret: &[u8]) -> Result<Vec<u8>, String> {
            self.activations += 1;
            Ok(blob.to_vec())
        }
        fn quote(&mut self, qualifying_data: &[u8], pcrs: &[u32]) -> Result<TpmQuote, String> {
            self.quotes.push(qualifying_data.to_vec());
            Ok(TpmQuote {
                attest: qualifying_data.to_vec(),
                signature: vec![9],
                pcr_values: pcrs.iter().map(|_| vec![0; 32]).collect(),
            })
        }
    }

    fn challenge(round: u32, credential: bool) -> bc_proto::TpmJoinChallenge {
        bc_proto::TpmJoinChallenge {
            round,
            credential_blob: if credential { vec![7; 4] } else { Vec::new() },
            encrypted_secret: if credential { vec![8; 4] } else { Vec::new() },
            qualifying_data: vec![round as u8; 32],
            pcrs: vec![0, 1, 2, 3, 4, 5, 6, 7],
        }
    }

    #[test]
    fn the_hello_names_the_ek_and_a_new_ak() {
        let mut tpm = FakeTpm::default();
        let hello = TpmRounds::hello(&mut tpm, vec![5; 32], bc_proto::HardwareClaims::default(), "1.0".into()).unwrap();
        assert_eq!((hello.ek_certificates, hello.ak_public), (vec![vec![0x30, 1]], vec![0, 1]));
    }

    #[test]
    fn round_one_activates_and_quotes_then_later_rounds_only_quote() {
        let mut tpm = FakeTpm::default();
        let mut rounds = TpmRounds::default();
        let first = rounds.answer(&mut tpm, &challenge(1, true)).unwrap();
        assert_eq!((first.credential, first.quote, first.pcr_values.len()), (vec![7; 4], vec![1; 32], 8));
        let second = rounds.answer(&mut tpm, &challenge(2, false)).unwrap();
        assert!(second.credential.is_empty());
        rounds.answer(&mut tpm, &challenge(3, false)).unwrap();
        assert_eq!((tpm.activations, tpm.quotes.len()), (1, 3));
        // No fourth round.
        assert!(rounds.answer(&mut tpm, &challenge(4, false)).unwrap_err().contains("at most 3"));
    }

    #[test]
    fn a_challenge_out_of_order_or_malformed_is_not_answered() {
        let mut tpm = FakeTpm::default();
        assert!(TpmRounds::default().answer(&mut tpm, &challenge(2, false)).is_err());
        assert!(TpmRounds::default().answer(&mut tpm, &challenge(1, false)).unwrap_err().contains("lacks"));
        let mut rounds = TpmRounds::default();
        rounds.answer(&mut tpm, &challenge(1, true)).unwrap();
        assert!(rounds.answer(&mut tpm, &challenge(1, true)).is_err(), "a round answered twice");
        assert!(rounds.answer(&mut tpm, &challenge(2, true)).unwrap_err().contains("carries"));
        let mut short = challenge(1, true);
        short.qualifying_data.pop();
        assert!(TpmRounds::default().answer(&mut tpm, &short).is_err());
        let mut pcr_24 = challenge(1, true);
        pcr_24.pcrs.push(24);
        assert!(TpmRounds::default().answer(&mut tpm, &pcr_24).is_err());
        // None of the refused challenges reached the TPM's quote.
        assert_eq!(tpm.quotes.len(), 1);
    }
}
