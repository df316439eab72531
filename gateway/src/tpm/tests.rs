//! The gateway's TPM checks against a software TPM (`soft_tpm.rs`), an EK certificate by a test
//! EK CA and one by another CA of the same name. The in-process test of the rounds
//! (`gateway/tests/tpm_join.rs`) uses the same software TPM; the swtpm end-to-end test
//! (`tests/tests/tpm_join.rs`) checks the same code against a real TPM 2.0 implementation.

use super::*;
use crate::tpm as tpm_api;

#[path = "soft_tpm.rs"]
mod soft_tpm;

use soft_tpm::{AK_ATTRIBUTES, CA, EK_CERT, EK_CERT_OF_OTHER_CA, EK_KEY, OTHER_CA, SoftTpm, der};

/// 2026-12-08: within every test certificate's validity (2026-12-07 to 2126).
const NOW_S: i64 = 1_796_688_000;
const LATER_S: i64 = NOW_S + 7 * 86_400;

fn bundle() -> EkCaBundle {
    EkCaBundle::from_pem(CA.as_bytes()).unwrap()
}

#[test]
fn an_ek_certificate_of_the_bundle_verifies_and_names_the_machine() {
    let ek = bundle().verify_chain(&[der(EK_CERT)], NOW_S).unwrap();
    assert!(ek.pin.starts_with("sha256/"), "{}", ek.pin);
    assert_eq!(ek.public, SoftTpm::new().ek.to_public_key());
    // The same TPM, another time: the same name and the same node.
    let again = bundle().verify_chain(&[der(EK_CERT)], LATER_S).unwrap();
    assert_eq!((again.pin.as_str(), node_id_of(&again.spki_der)), (ek.pin.as_str(), node_id_of(&ek.spki_der)));
    // A bundle of several CAs finds the one that signed.
    let both = EkCaBundle::from_pem(format!("{OTHER_CA}{CA}").as_bytes()).unwrap();
    assert_eq!(both.len(), 2);
    assert_eq!(both.verify_chain(&[der(EK_CERT)], NOW_S).unwrap().pin, ek.pin);
}

#[test]
fn an_ek_certificate_not_of_the_bundle_is_untrusted() {
    let code = |bundle: &EkCaBundle, chain: &[Vec<u8>], now_s: i64| bundle.verify_chain(chain, now_s).unwrap_err().code;
    // Another CA of the same name signed it.
    assert_eq!(code(&bundle(), &[der(EK_CERT_OF_OTHER_CA)], NOW_S), "TPM_EK_UNTRUSTED");
    // The bundle is another CA's.
    let other = EkCaBundle::from_pem(OTHER_CA.as_bytes()).unwrap();
    assert_eq!(code(&other, &[der(EK_CERT)], NOW_S), "TPM_EK_UNTRUSTED");
    // Its signature changed.
    let mut tampered = der(EK_CERT);
    let last = tampered.len() - 3;
    tampered[last] ^= 1;
    assert_eq!(code(&bundle(), &[tampered], NOW_S), "TPM_EK_UNTRUSTED");
    // Before it was issued, or after it ended.
    assert_eq!(code(&bundle(), &[der(EK_CERT)], NOW_S - 365 * 86_400), "TPM_EK_UNTRUSTED");
    assert_eq!(code(&bundle(), &[der(EK_CERT)], 5_000_000_000), "TPM_EK_UNTRUSTED");
    // An end-entity certificate is no intermediate: the other CA's EK certificate does not
    // lift a certificate it did not sign.
    assert_eq!(code(&bundle(), &[der(EK_CERT_OF_OTHER_CA), der(EK_CERT)], NOW_S), "TPM_EK_UNTRUSTED");
    // No certificate, too many, not DER, trailing bytes.
    assert_eq!(code(&bundle(), &[], NOW_S), "TPM_MALFORMED");
    assert_eq!(code(&bundle(), &vec![der(EK_CERT); EK_CHAIN_CERTIFICATES_MAX + 1], NOW_S), "TPM_MALFORMED");
    assert_eq!(code(&bundle(), &[b"not a certificate".to_vec()], NOW_S), "TPM_MALFORMED");
    let mut trailing = der(EK_CERT);
    trailing.push(0);
    assert_eq!(code(&bundle(), &[trailing], NOW_S), "TPM_MALFORMED");
}

#[test]
fn an_ek_ca_bundle_holds_certificates_only() {
    assert!(EkCaBundle::from_pem(b"").unwrap_err().contains("no certificate"));
    assert!(EkCaBundle::from_pem(EK_KEY.as_bytes()).unwrap_err().contains("PRIVATE KEY"));
    let broken = CA.replace("MII", "MIX");
    assert!(EkCaBundle::from_pem(broken.as_bytes()).is_err());
    assert!(EkCaBundle::from_pem(&vec![b' '; EK_CA_BUNDLE_BYTES_MAX + 1]).is_err());
}

#[test]
fn an_attestation_key_is_a_restricted_signing_key_that_never_left_its_tpm() {
    let tpm = SoftTpm::new();
    let ak = AkPublic::parse(&tpm.ak_public()).unwrap();
    assert_eq!(ak.public, tpm.ak.to_public_key());
    assert_eq!(&ak.name[..2], &TPM_ALG_SHA256.to_be_bytes());
    assert_eq!(&ak.name[2..], Sha256::digest(tpm.ak_public()).as_slice());
    for (attributes, why) in [
        (AK_ATTRIBUTES & !ATTR_RESTRICTED, "not restricted"),
        (AK_ATTRIBUTES & !ATTR_FIXED_TPM, "may leave its TPM"),
        (AK_ATTRIBUTES & !ATTR_SENSITIVE_DATA_ORIGIN, "imported"),
        (AK_ATTRIBUTES | ATTR_DECRYPT, "decrypts"),
    ] {
        assert_eq!(AkPublic::parse(&tpm.ak_public_with(attributes)).unwrap_err().code, "TPM_AK_UNFIT", "{why}");
    }
    let mut trailing = tpm.ak_public();
    trailing.push(0);
    assert_eq!(AkPublic::parse(&trailing).unwrap_err().code, "TPM_MALFORMED");
    let public = tpm.ak_public();
    assert_eq!(AkPublic::parse(&public[..public.len() - 1]).unwrap_err().code, "TPM_MALFORMED");
    assert_eq!(AkPublic::parse(&vec![0; AK_PUBLIC_BYTES_MAX + 1]).unwrap_err().code, "TPM_MALFORMED");
}

#[test]
fn a_credential_opens_only_in_the_tpm_of_the_ek_for_the_ak_named() {
    let tpm = SoftTpm::new();
    let ek = bundle().verify_chain(&[der(EK_CERT)], NOW_S).unwrap();
    let ak = AkPublic::parse(&tpm.ak_public()).unwrap();
    let credential = [7u8; CREDENTIAL_BYTES];
    let made = make_credential(&ek.public, &ak.name, &credential, &mut rand::rng()).unwrap();
    let returned = tpm.activate(&made, &ak.name).unwrap();
    assert_eq!(returned, credential);
    check_credential(&credential, &returned).unwrap();
    // Each credential has its own seed.
    assert_ne!(make_credential(&ek.public, &ak.name, &credential, &mut rand::rng()).unwrap(), made);
    // A TPM holding the EK but another AK (another name) cannot open it.
    let mut other_name = ak.name.clone();
    other_name[5] ^= 1;
    assert_eq!(tpm.activate(&made, &other_name), Err("TPM_RC_INTEGRITY"));
    // Nor a blob changed on the way.
    let mut tampered = made.clone();
    let last = tampered.credential_blob.len() - 1;
    tampered.credential_blob[last] ^= 1;
    assert_eq!(tpm.activate(&tampered, &ak.name), Err("TPM_RC_INTEGRITY"));
    // Another credential, or none, is refused.
    assert_eq!(check_credential(&credential, &[8u8; CREDENTIAL_BYTES]).unwrap_err().code, "TPM_CREDENTIAL");
    assert_eq!(check_credential(&credential, &credential[..31]).unwrap_err().code, "TPM_CREDENTIAL");
}

#[test]
fn a_quote_verifies_for_its_nonce_its_ak_and_its_pcr_values() {
    let tpm = SoftTpm::new();
    let ak = AkPublic::parse(&tpm.ak_public()).unwrap();
    let node_key = [9u8; 32];
    let nonce = [1u8; NONCE_BYTES];
    let expected = qualifying_data(&nonce, &node_key);
    let (attest, signature) = tpm.quote(&expected);
    let quote = Quote::verify(&attest, &signature, &ak, &expected, &tpm.pcrs).unwrap();
    assert_eq!((quote.pcrs.as_slice(), quote.clock_ms, quote.reset_count), (&QUOTED_PCRS[..], 123_456, 1));
    let code = |attest: &[u8], signature: &[u8], expected: &[u8; 32], pcrs: &[Vec<u8>]| {
        Quote::verify(attest, signature, &ak, expected, pcrs).unwrap_err().code
    };
    // Another round's nonce (a replayed quote), or another node key's.
    let later = qualifying_data(&[2u8; NONCE_BYTES], &node_key);
    assert_eq!(code(&attest, &signature, &later, &tpm.pcrs), "TPM_QUOTE_NONCE");
    assert_eq!(code(&attest, &signature, &qualifying_data(&nonce, &[8u8; 32]), &tpm.pcrs), "TPM_QUOTE_NONCE");
    // The quote changed after signing (its clock), or its signature.
    let mut changed = attest.clone();
    // From the end: the PCR digest, the selection, the firmware version, the clock's safe flag,
    // restarts and resets, then the clock's last byte.
    let clock_at = attest.len() - (2 + 32) - (4 + 2 + 1 + 3) - 8 - 1 - 4 - 4 - 1;
    changed[clock_at] ^= 1;
    assert_eq!(code(&changed, &signature, &expected, &tpm.pcrs), "TPM_QUOTE_SIGNATURE");
    let mut forged = signature.clone();
    let last = forged.len() - 1;
    forged[last] ^= 1;
    assert_eq!(code(&attest, &forged, &expected, &tpm.pcrs), "TPM_QUOTE_SIGNATURE");
    // Signed by another key than the AK.
    let (by_ek, by_ek_signature) = tpm.quote_by(&tpm.ek, TPM_ST_ATTEST_QUOTE, &expected, &QUOTED_PCRS);
    assert_eq!(code(&by_ek, &by_ek_signature, &expected, &tpm.pcrs), "TPM_QUOTE_SIGNATURE");
    // PCR values other than those quoted.
    let mut pcrs = tpm.pcrs.clone();
    pcrs[4][0] ^= 1;
    assert_eq!(code(&attest, &signature, &expected, &pcrs), "TPM_PCR_DIGEST");
    assert_eq!(code(&attest, &signature, &expected, &tpm.pcrs[..7]), "TPM_MALFORMED");
    // Not a quote, or over other PCRs.
    let (certify, certify_signature) = tpm.quote_by(&tpm.ak, 0x8017, &expected, &QUOTED_PCRS);
    assert_eq!(code(&certify, &certify_signature, &expected, &tpm.pcrs), "TPM_MALFORMED");
    let (fewer, fewer_signature) = tpm.quote_by(&tpm.ak, TPM_ST_ATTEST_QUOTE, &expected, &[0, 1, 2]);
    assert_eq!(code(&fewer, &fewer_signature, &expected, &tpm.pcrs), "TPM_MALFORMED");
    // Truncated, or with a byte after it.
    assert_eq!(code(&attest[..attest.len() - 1], &signature, &expected, &tpm.pcrs), "TPM_MALFORMED");
    let mut trailing = attest.clone();
    trailing.push(0);
    assert_eq!(code(&trailing, &signature, &expected, &tpm.pcrs), "TPM_MALFORMED");
}

#[test]
fn cfb_goes_both_ways_at_any_length() {
    let key = [3u8; 16];
    for length in [0, 1, 15, 16, 17, 34, 100] {
        let plain: Vec<u8> = (0..length as u8).collect();
        let encrypted = aes128_cfb(&key, &plain, false);
        assert_eq!(encrypted.len(), plain.len());
        if length > 0 {
            assert_ne!(encrypted, plain);
        }
        assert_eq!(aes128_cfb(&key, &encrypted, true), plain, "{length}");
    }
}

#[test]
fn kdfa_gives_the_bits_asked_and_depends_on_every_input() {
    let base = kdfa(b"seed", "STORAGE", b"name", b"", 128);
    assert_eq!(base.len(), 16);
    assert_eq!(kdfa(b"seed", "INTEGRITY", b"", b"", 256).len(), 32);
    assert_eq!(kdfa(b"seed", "X", b"", b"", 520).len(), 65);
    for other in [
        kdfa(b"seeD", "STORAGE", b"name", b"", 128),
        kdfa(b"seed", "STORAGF", b"name", b"", 128),
        kdfa(b"seed", "STORAGE", b"namf", b"", 128),
        kdfa(b"seed", "STORAGE", b"name", b"", 256)[..16].to_vec(),
    ] {
        assert_ne!(other, base);
    }
}
