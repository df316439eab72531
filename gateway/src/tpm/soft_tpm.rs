//! A software TPM for the tests, never built into the gateway: included by path from the unit
//! tests (`tpm/tests.rs`) and from the in-process test of the rounds (`gateway/tests/tpm_join.rs`),
//! each of which names the gateway's `tpm` module `tpm_api` beside it. Fixed RSA keys for its EK
//! and AK (`testdata/`, made once with openssl: keys are slow to generate in a debug build), eight
//! PCRs, and the TPM's side of ActivateCredential and Quote written from the specification,
//! apart from the code under test's wrapping (only KDFa, CFB and the outer HMAC are shared).
// Each includer uses a part.
#![allow(dead_code)]

use rsa::pkcs8::DecodePrivateKey;
use rsa::traits::PublicKeyParts;
use sha2::{Digest, Sha256};

use super::tpm_api::{
    ATTR_FIXED_PARENT, ATTR_FIXED_TPM, ATTR_RESTRICTED, ATTR_SENSITIVE_DATA_ORIGIN, ATTR_SIGN, IDENTITY_LABEL, MadeCredential,
    QUOTED_PCRS, TPM_ALG_NULL, TPM_ALG_RSA, TPM_ALG_RSASSA, TPM_ALG_SHA256, TPM_GENERATED_VALUE, TPM_ST_ATTEST_QUOTE, aes128_cfb,
    kdfa, outer_hmac, pcr_digest,
};

pub const CA: &str = include_str!("testdata/ca.pem");
pub const OTHER_CA: &str = include_str!("testdata/other-ca.pem");
pub const EK_CERT: &str = include_str!("testdata/ek.pem");
pub const EK_CERT_OF_OTHER_CA: &str = include_str!("testdata/ek-other-ca.pem");
pub const EK_KEY: &str = include_str!("testdata/ek.key");
const AK_KEY: &str = include_str!("testdata/ak.key");

/// The attributes an AK made by `TPM2_Create` under the EK has (`userWithAuth` too).
pub const AK_ATTRIBUTES: u32 =
    ATTR_FIXED_TPM | ATTR_FIXED_PARENT | ATTR_SENSITIVE_DATA_ORIGIN | (1 << 6) | ATTR_RESTRICTED | ATTR_SIGN;

/// A PEM certificate's DER.
pub fn der(pem: &str) -> Vec<u8> {
    x509_parser::pem::parse_x509_pem(pem.as_bytes()).expect("a PEM block").1.contents
}

/// The TPM's side, in software: an EK and an AK, and eight PCRs.
pub struct SoftTpm {
    pub ek: rsa::PrivateKey,
    pub ak: rsa::PrivateKey,
    pub pcrs: Vec<Vec<u8>>,
}

impl SoftTpm {
    pub fn new() -> Self {
        Self {
            ek: rsa::PrivateKey::from_pkcs8_pem(EK_KEY).unwrap(),
            ak: rsa::PrivateKey::from_pkcs8_pem(AK_KEY).unwrap(),
            pcrs: (0..8u8).map(|i| vec![i; 32]).collect(),
        }
    }

    /// The AK's `TPMT_PUBLIC` with these attributes, as a TPM marshals it.
    pub fn ak_public_with(&self, attributes: u32) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&TPM_ALG_RSA.to_be_bytes());
        out.extend_from_slice(&TPM_ALG_SHA256.to_be_bytes());
        out.extend_from_slice(&attributes.to_be_bytes());
        out.extend_from_slice(&0u16.to_be_bytes()); // no auth policy
        out.extend_from_slice(&TPM_ALG_NULL.to_be_bytes()); // symmetric
        out.extend_from_slice(&TPM_ALG_RSASSA.to_be_bytes());
        out.extend_from_slice(&TPM_ALG_SHA256.to_be_bytes());
        out.extend_from_slice(&2048u16.to_be_bytes());
        out.extend_from_slice(&0u32.to_be_bytes()); // the default exponent
        let modulus = self.ak.to_public_key().n_bytes();
        out.extend_from_slice(&(modulus.len() as u16).to_be_bytes());
        out.extend_from_slice(&modulus);
        out
    }

    pub fn ak_public(&self) -> Vec<u8> {
        self.ak_public_with(AK_ATTRIBUTES)
    }

    /// TPM2_ActivateCredential: the seed with the EK, the outer HMAC checked for the AK's name,
    /// then the credential.
    pub fn activate(&self, made: &MadeCredential, ak_name: &[u8]) -> Result<Vec<u8>, &'static str> {
        let seed = self
            .ek
            .decrypt(rsa::Oaep::<Sha256>::new_with_label(IDENTITY_LABEL), &made.encrypted_secret)
            .map_err(|_| "the secret does not open")?;
        let blob = &made.credential_blob;
        let hmac_size = u16::from_be_bytes([blob[0], blob[1]]) as usize;
        let (hmac, encrypted) = blob[2..].split_at(hmac_size);
        if outer_hmac(&kdfa(&seed, "INTEGRITY", &[], &[], 256), encrypted, ak_name) != hmac {
            return Err("TPM_RC_INTEGRITY");
        }
        let plain = aes128_cfb(&kdfa(&seed, "STORAGE", ak_name, &[], 128), encrypted, true);
        let size = u16::from_be_bytes([plain[0], plain[1]]) as usize;
        plain.get(2..2 + size).map(<[u8]>::to_vec).ok_or("no identity")
    }

    /// A `TPMS_ATTEST` of `kind` over `pcrs` of the SHA-256 bank with `extra_data`, its digest
    /// over `values` (the PCRs as they were when quoted), and its `TPMT_SIGNATURE` by `key`.
    pub fn quote_of(
        &self,
        key: &rsa::PrivateKey,
        kind: u16,
        extra_data: &[u8],
        pcrs: &[u32],
        values: &[Vec<u8>],
    ) -> (Vec<u8>, Vec<u8>) {
        let mut a = Vec::new();
        a.extend_from_slice(&TPM_GENERATED_VALUE.to_be_bytes());
        a.extend_from_slice(&kind.to_be_bytes());
        a.extend_from_slice(&2u16.to_be_bytes());
        a.extend_from_slice(&[0x40, 0x00]); // the signer's qualified name (not checked)
        a.extend_from_slice(&(extra_data.len() as u16).to_be_bytes());
        a.extend_from_slice(extra_data);
        a.extend_from_slice(&123_456u64.to_be_bytes()); // clock
        a.extend_from_slice(&1u32.to_be_bytes()); // resets
        a.extend_from_slice(&0u32.to_be_bytes()); // restarts
        a.push(1); // safe
        a.extend_from_slice(&0x2000_0000u64.to_be_bytes()); // firmware
        a.extend_from_slice(&1u32.to_be_bytes());
        a.extend_from_slice(&TPM_ALG_SHA256.to_be_bytes());
        let mut bitmap = [0u8; 3];
        for pcr in pcrs {
            bitmap[(*pcr / 8) as usize] |= 1 << (pcr % 8);
        }
        a.push(3);
        a.extend_from_slice(&bitmap);
        let quoted: Vec<Vec<u8>> = pcrs.iter().map(|p| values[*p as usize].clone()).collect();
        a.extend_from_slice(&32u16.to_be_bytes());
        a.extend_from_slice(&pcr_digest(&quoted));
        let signature = key.sign(rsa::Pkcs1v15Sign::new::<Sha256>(), &Sha256::digest(&a)).unwrap();
        let mut s = Vec::new();
        s.extend_from_slice(&TPM_ALG_RSASSA.to_be_bytes());
        s.extend_from_slice(&TPM_ALG_SHA256.to_be_bytes());
        s.extend_from_slice(&(signature.len() as u16).to_be_bytes());
        s.extend_from_slice(&signature);
        (a, s)
    }

    pub fn quote_by(&self, key: &rsa::PrivateKey, kind: u16, extra_data: &[u8], pcrs: &[u32]) -> (Vec<u8>, Vec<u8>) {
        self.quote_of(key, kind, extra_data, pcrs, &self.pcrs)
    }

    pub fn quote(&self, extra_data: &[u8]) -> (Vec<u8>, Vec<u8>) {
        self.quote_by(&self.ak, TPM_ST_ATTEST_QUOTE, extra_data, &QUOTED_PCRS)
    }
}
