//! The machine's TPM 2.0 through the TSS's Enhanced System API (`tss-esapi`, over Debian's
//! `libtss2-esys`; feature `tpm`): the EK made from the standard RSA 2048 template (the key its
//! certificate in NV index 0x01c00002 is for), an RSA 2048 attestation key made under it
//! (restricted, signing, RSASSA-SHA256), ActivateCredential with the EK's policy
//! (PolicySecret of the endorsement hierarchy) and Quote over the SHA-256 bank.
//!
//! Everything lives in the one `Context` for the join's life; the TPM's resource manager (or
//! swtpm) flushes the transient keys when it closes.

use std::str::FromStr;

use tss_esapi::abstraction::{AsymmetricAlgorithmSelection, ak, ek, pcr};
use tss_esapi::constants::SessionType;
use tss_esapi::handles::{AuthHandle, KeyHandle, SessionHandle};
use tss_esapi::interface_types::algorithm::{AsymmetricAlgorithm, HashingAlgorithm, SignatureSchemeAlgorithm};
use tss_esapi::interface_types::key_bits::RsaKeyBits;
use tss_esapi::interface_types::session_handles::PolicySession;
use tss_esapi::structures::{
    Data, EncryptedSecret, IdObject, PcrSelectionListBuilder, PcrSlot, SignatureScheme, SymmetricDefinition,
};
use tss_esapi::traits::Marshall;
use tss_esapi::{Context, TctiNameConf};

use super::{Tpm, TpmQuote};

/// A TPM reached over a TCTI.
pub struct EsapiTpm {
    context: Context,
    ek: KeyHandle,
    /// The attestation key, once made.
    ak: Option<KeyHandle>,
}

fn said(what: &str) -> impl Fn(tss_esapi::Error) -> String + '_ {
    move |e| format!("the TPM: {what}: {e}")
}

impl EsapiTpm {
    /// Opens the TPM at `tcti` (`device:/dev/tpmrm0`, `swtpm:host=…,port=…`) and makes its EK.
    pub fn open(tcti: &str) -> Result<Self, String> {
        let conf = TctiNameConf::from_str(tcti).map_err(|e| format!("the TPM's TCTI {tcti:?}: {e}"))?;
        let mut context = Context::new(conf).map_err(|e| format!("opening the TPM at {tcti}: {e}"))?;
        let ek = ek::create_ek_object(&mut context, AsymmetricAlgorithm::Rsa, None).map_err(said("making the EK"))?;
        Ok(Self { context, ek, ak: None })
    }
}

impl Tpm for EsapiTpm {
    fn ek_certificates(&mut self) -> Result<Vec<Vec<u8>>, String> {
        let certificate = ek::retrieve_ek_pubcert(&mut self.context, AsymmetricAlgorithmSelection::Rsa(RsaKeyBits::Rsa2048))
            .map_err(said("reading the RSA EK certificate from NV"))?;
        Ok(vec![certificate])
    }

    fn ak_public(&mut self) -> Result<Vec<u8>, String> {
        let created =
            ak::create_ak(&mut self.context, self.ek, HashingAlgorithm::Sha256, SignatureSchemeAlgorithm::RsaSsa, None, None)
                .map_err(said("making the attestation key"))?;
        let public = created.out_public.marshall().map_err(said("the attestation key's public area"))?;
        let handle = ak::load_ak(&mut self.context, self.ek, None, created.out_private, created.out_public)
            .map_err(said("loading the attestation key"))?;
        self.ak = Some(handle);
        Ok(public)
    }

    fn activate_credential(&mut self, credential_blob: &[u8], encrypted_secret: &[u8]) -> Result<Vec<u8>, String> {
        let ak = self.ak.ok_or("the attestation key is not made yet")?;
        let blob = IdObject::try_from(credential_blob.to_vec()).map_err(said("the credential blob"))?;
        let secret = EncryptedSecret::try_from(encrypted_secret.to_vec()).map_err(said("the encrypted secret"))?;
        let context = &mut self.context;
        // The AK's authorization (empty) in an HMAC session; the EK's by its policy:
        // PolicySecret of the endorsement hierarchy.
        let hmac = context
            .start_auth_session(None, None, None, SessionType::Hmac, SymmetricDefinition::AES_128_CFB, HashingAlgorithm::Sha256)
            .map_err(said("a session"))?
            .ok_or("the TPM started no session")?;
        let policy = context
            .start_auth_session(None, None, None, SessionType::Policy, SymmetricDefinition::AES_128_CFB, HashingAlgorithm::Sha256)
            .map_err(said("a policy session"))?
            .ok_or("the TPM started no policy session")?;
        let policy_session = PolicySession::try_from(policy).map_err(said("the policy session"))?;
        context
            .execute_with_session(Some(hmac), |ctx| {
                ctx.policy_secret(
                    policy_session,
                    AuthHandle::Endorsement,
                    Default::default(),
                    Default::default(),
                    Default::default(),
                    None,
                )
            })
            .map_err(said("the EK's policy"))?;
        context.set_sessions((Some(hmac), Some(policy), None));
        let result = context.activate_credential(ak, self.ek, blob, secret);
        context.clear_sessions();
        let _ = context.flush_context(SessionHandle::from(hmac).into());
        let _ = context.flush_context(SessionHandle::from(policy).into());
        let credential = result.map_err(said("ActivateCredential (was the credential made for this TPM's EK and AK?)"))?;
        Ok(credential.value().to_vec())
    }

    fn quote(&mut self, qualifying_data: &[u8], pcrs: &[u32]) -> Result<TpmQuote, String> {
        let ak = self.ak.ok_or("the attestation key is not made yet")?;
        let slots: Vec<PcrSlot> =
            pcrs.iter().map(|p| PcrSlot::try_from(1u32 << p).map_err(said("a PCR"))).collect::<Result<_, _>>()?;
        let selection = PcrSelectionListBuilder::new()
            .with_selection(HashingAlgorithm::Sha256, &slots)
            .build()
            .map_err(said("the PCR selection"))?;
        let data = Data::try_from(qualifying_data.to_vec()).map_err(said("the qualifying data"))?;
        let (attest, signature) = self
            .context
            .execute_with_nullauth_session(|ctx| ctx.quote(ak, data, SignatureScheme::Null, selection.clone()))
            .map_err(said("Quote"))?;
        let read = pcr::read_all(&mut self.context, selection).map_err(said("reading the PCRs"))?;
        let bank = read.pcr_bank(HashingAlgorithm::Sha256).ok_or("the TPM has no SHA-256 PCR bank")?;
        let pcr_values = slots
            .iter()
            .map(|slot| {
                bank.get_digest(*slot).map(|d| d.value().to_vec()).ok_or_else(|| format!("the TPM did not read PCR {slot:?}"))
            })
            .collect::<Result<_, _>>()?;
        Ok(TpmQuote {
            attest: attest.marshall().map_err(said("the quote"))?,
            signature: signature.marshall().map_err(said("the quote's signature"))?,
            pcr_values,
        })
    }
}
