//! TPM 2.0 attestation, the gateway's side of `bcd join --attestor tpm` (docs/admission.md):
//! pure functions of bytes, with no IO and no TPM, so every check is unit tested with tampered
//! inputs. The agents' endpoint (`agents/tpm_join.rs`) carries the rounds and appends the join.
//!
//! - [`EkCaBundle`]: the deployment's EK CA bundle (`--tpm-ek-ca-bundle`, PEM), and
//!   [`EkCaBundle::verify_chain`]: the machine's EK certificate, through the intermediates it
//!   sent, signed by a certificate of the bundle, each valid now. The EK's public key (its
//!   certificate's SubjectPublicKeyInfo) names the machine: [`VerifiedEk::pin`].
//! - [`AkPublic::parse`]: the attestation key's `TPMT_PUBLIC`, its name (`nameAlg ‖
//!   SHA-256(TPMT_PUBLIC)`) and RSA key, refused unless it is a restricted signing key that never
//!   left its TPM (`fixedTPM`, `fixedParent`, `sensitiveDataOrigin`).
//! - [`make_credential`]: TPM2_MakeCredential in software against the EK's public key (TPM 2.0
//!   Part 1 §24, Part 3 §12.6): a seed sealed with RSA-OAEP (SHA-256, label `IDENTITY\0`), the
//!   credential encrypted with AES-128-CFB under `KDFa(seed, "STORAGE", AK name)` and bound by an
//!   HMAC under `KDFa(seed, "INTEGRITY")`. Only the TPM holding the EK, with the AK of that name
//!   loaded, gets the credential back (TPM2_ActivateCredential): the AK is that TPM's.
//! - [`Quote::parse`] and [`Quote::verify`]: a `TPMS_ATTEST` of type quote, signed by the AK
//!   (RSASSA-PKCS1-v1_5, SHA-256), whose `extraData` is this join's qualifying data
//!   ([`qualifying_data`]: the gateway's fresh nonce and the node's key, so an old quote or one
//!   made for another node key is refused), over the SHA-256 bank's [`QUOTED_PCRS`], whose digest is
//!   that of the PCR values the machine sent.
//!
//! Invariants: every length read from the wire is bounded before it is used; every refusal
//! carries a stable code ([`TpmRefusal::code`]) that `bcd join` prints and the tests match.

use rsa::BoxedUint;
use sha2::{Digest, Sha256};
use x509_parser::prelude::{FromDer, X509Certificate};

/// TPM algorithm identifiers (TPM 2.0 Part 2, `TPM_ALG_ID`).
pub const TPM_ALG_RSA: u16 = 0x0001;
pub const TPM_ALG_AES: u16 = 0x0006;
pub const TPM_ALG_SHA256: u16 = 0x000B;
pub const TPM_ALG_NULL: u16 = 0x0010;
pub const TPM_ALG_RSASSA: u16 = 0x0014;
pub const TPM_ALG_CFB: u16 = 0x0043;
/// `TPM_GENERATED_VALUE`: every structure the TPM signs as an attestation starts with it, so a
/// signature over outside data cannot pass for one.
pub const TPM_GENERATED_VALUE: u32 = 0xff54_4347;
/// `TPM_ST_ATTEST_QUOTE`.
pub const TPM_ST_ATTEST_QUOTE: u16 = 0x8018;

/// `TPMA_OBJECT` bits an attestation key must have (and `decrypt`, which it must not).
pub const ATTR_FIXED_TPM: u32 = 1 << 1;
pub const ATTR_FIXED_PARENT: u32 = 1 << 4;
pub const ATTR_SENSITIVE_DATA_ORIGIN: u32 = 1 << 5;
pub const ATTR_RESTRICTED: u32 = 1 << 16;
pub const ATTR_DECRYPT: u32 = 1 << 17;
pub const ATTR_SIGN: u32 = 1 << 18;
const AK_ATTRIBUTES_REQUIRED: u32 = ATTR_FIXED_TPM | ATTR_FIXED_PARENT | ATTR_SENSITIVE_DATA_ORIGIN | ATTR_RESTRICTED | ATTR_SIGN;

/// Certificates a machine sends: its EK certificate and the intermediates up to the bundle.
pub const EK_CHAIN_CERTIFICATES_MAX: usize = 4;
/// The largest certificate taken (an EK certificate is about 1 KiB).
pub const EK_CERTIFICATE_BYTES_MAX: usize = 4096;
/// Certificates an EK CA bundle may hold (TPM vendors' roots and intermediates).
pub const EK_CA_BUNDLE_CERTIFICATES_MAX: usize = 256;
/// The largest EK CA bundle file read.
pub const EK_CA_BUNDLE_BYTES_MAX: usize = 1024 * 1024;
/// The largest `TPMT_PUBLIC`, `TPMS_ATTEST` and `TPMT_SIGNATURE` taken.
pub const AK_PUBLIC_BYTES_MAX: usize = 1024;
pub const ATTEST_BYTES_MAX: usize = 1024;
pub const SIGNATURE_BYTES_MAX: usize = 1024;
/// The credential the gateway makes and the TPM gives back: a SHA-256-sized secret.
pub const CREDENTIAL_BYTES: usize = 32;
/// The gateway's nonce per quote round.
pub const NONCE_BYTES: usize = 32;
/// The PCRs every join quotes, of the SHA-256 bank: the firmware, its configuration, option
/// ROMs, the boot loader and the platform's state (0 to 7: what a measured boot covers before
/// the operating system).
pub const QUOTED_PCRS: [u32; 8] = [0, 1, 2, 3, 4, 5, 6, 7];
/// RSA key sizes taken for the EK and the AK.
pub const RSA_BITS_MIN: usize = 2048;
pub const RSA_BITS_MAX: usize = 4096;
/// Quote rounds a join may take: a round whose PCR values do not match its quote's digest (a
/// PCR extended between the read and the quote) is asked again with a new nonce, at most this
/// many rounds in all.
pub const CHALLENGE_ROUNDS_MAX: u32 = 3;
const _: () = assert!(CHALLENGE_ROUNDS_MAX >= 1);

/// The label RSA-OAEP seals a credential's seed under (TPM 2.0 Part 1 §24.4, with its NUL).
pub const IDENTITY_LABEL: &[u8] = b"IDENTITY\0";
/// The domain tag of [`qualifying_data`].
const QUALIFYING_DATA_TAG: &[u8] = b"better-compute/tpm-join/v1\n";

/// Why a TPM's evidence is refused: a stable code and what to tell the machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TpmRefusal {
    /// `TPM_MALFORMED`, `TPM_EK_UNTRUSTED`, `TPM_AK_UNFIT`, `TPM_CREDENTIAL`, `TPM_QUOTE_NONCE`,
    /// `TPM_QUOTE_SIGNATURE`, `TPM_PCR_DIGEST` (and, from the endpoint, `TPM_ALREADY_JOINED`,
    /// `TPM_NOT_CONFIGURED`).
    pub code: &'static str,
    pub message: String,
}

impl std::fmt::Display for TpmRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

pub fn refusal(code: &'static str, message: impl Into<String>) -> TpmRefusal {
    TpmRefusal { code, message: message.into() }
}

fn malformed(what: &str) -> TpmRefusal {
    refusal("TPM_MALFORMED", format!("{what} is not well formed"))
}

/// A reader of TPM's big-endian marshalling, refusing any read past the end.
struct Reader<'a> {
    bytes: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8], what: &'static str) -> Self {
        Self { bytes, what }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], TpmRefusal> {
        if self.bytes.len() < n {
            return Err(malformed(self.what));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, TpmRefusal> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, TpmRefusal> {
        Ok(u16::from_be_bytes(self.take(2)?.try_into().expect("two bytes")))
    }

    fn u32(&mut self) -> Result<u32, TpmRefusal> {
        Ok(u32::from_be_bytes(self.take(4)?.try_into().expect("four bytes")))
    }

    fn u64(&mut self) -> Result<u64, TpmRefusal> {
        Ok(u64::from_be_bytes(self.take(8)?.try_into().expect("eight bytes")))
    }

    /// A `TPM2B_*`: a 2-byte size and that many bytes.
    fn sized(&mut self) -> Result<&'a [u8], TpmRefusal> {
        let n = self.u16()? as usize;
        self.take(n)
    }

    fn end(&self) -> Result<(), TpmRefusal> {
        if self.bytes.is_empty() { Ok(()) } else { Err(malformed(self.what)) }
    }
}

/// `sha256/` and the standard base64 of SHA-256 over `bytes`: the project's one pin format.
pub fn pin_of(bytes: &[u8]) -> String {
    use base64::Engine as _;
    format!("sha256/{}", base64::engine::general_purpose::STANDARD.encode(Sha256::digest(bytes)))
}

/// An RSA public key from its big-endian modulus and exponent, within the sizes taken.
fn rsa_key(modulus: &[u8], exponent: &[u8], what: &str) -> Result<rsa::PublicKey, TpmRefusal> {
    let modulus = strip_zeros(modulus);
    let exponent = strip_zeros(exponent);
    let bits = modulus.len() * 8;
    if !(RSA_BITS_MIN..=RSA_BITS_MAX).contains(&bits) || exponent.is_empty() || exponent.len() > 8 {
        return Err(refusal("TPM_MALFORMED", format!("{what} is not an RSA key of {RSA_BITS_MIN} to {RSA_BITS_MAX} bits")));
    }
    let n = BoxedUint::from_be_slice(modulus, bits as u32).map_err(|_| malformed(what))?;
    let e = BoxedUint::from_be_slice(exponent, 64).map_err(|_| malformed(what))?;
    rsa::PublicKey::new(n, e).map_err(|e| refusal("TPM_MALFORMED", format!("{what}: {e}")))
}

fn strip_zeros(bytes: &[u8]) -> &[u8] {
    let first = bytes.iter().position(|b| *b != 0).unwrap_or(bytes.len());
    &bytes[first..]
}

/// The deployment's EK CA bundle: the certificates an EK certificate may chain to (TPM
/// vendors' roots, or intermediates trusted as such).
#[derive(Clone, Debug)]
pub struct EkCaBundle {
    /// DER, each parsed once at load.
    certificates: Vec<Vec<u8>>,
}

/// An EK certificate chain that verified: the EK's key, and the pin that names the machine.
#[derive(Clone, Debug)]
pub struct VerifiedEk {
    /// The EK certificate's SubjectPublicKeyInfo (DER).
    pub spki_der: Vec<u8>,
    /// `sha256/` of `spki_der`: the machine's name, the same at every join of this TPM.
    pub pin: String,
    pub public: rsa::PublicKey,
}

impl EkCaBundle {
    /// Reads a PEM bundle: one or more `CERTIFICATE` blocks, at most
    /// [`EK_CA_BUNDLE_CERTIFICATES_MAX`], each a certificate.
    pub fn from_pem(pem: &[u8]) -> Result<Self, String> {
        if pem.len() > EK_CA_BUNDLE_BYTES_MAX {
            return Err(format!("an EK CA bundle is at most {EK_CA_BUNDLE_BYTES_MAX} bytes"));
        }
        let mut certificates = Vec::new();
        for block in x509_parser::pem::Pem::iter_from_buffer(pem) {
            let block = block.map_err(|e| format!("the EK CA bundle is not PEM: {e}"))?;
            if block.label != "CERTIFICATE" {
                return Err(format!("the EK CA bundle holds a {:?} block; only certificates", block.label));
            }
            X509Certificate::from_der(&block.contents)
                .map_err(|e| format!("certificate {} of the EK CA bundle: {e}", certificates.len() + 1))?;
            certificates.push(block.contents);
            if certificates.len() > EK_CA_BUNDLE_CERTIFICATES_MAX {
                return Err(format!("an EK CA bundle holds at most {EK_CA_BUNDLE_CERTIFICATES_MAX} certificates"));
            }
        }
        if certificates.is_empty() {
            return Err("the EK CA bundle holds no certificate".into());
        }
        Ok(Self { certificates })
    }

    /// How many certificates the bundle holds.
    pub fn len(&self) -> usize {
        self.certificates.len()
    }

    pub fn is_empty(&self) -> bool {
        self.certificates.is_empty()
    }

    /// Checks `chain` (the EK certificate, then intermediates) at `now_s` (Unix seconds): each
    /// certificate on the path valid then, each signed by the next, the last by a certificate of
    /// the bundle; the EK's key an RSA key. At most [`EK_CHAIN_CERTIFICATES_MAX`] certificates.
    pub fn verify_chain(&self, chain: &[Vec<u8>], now_s: i64) -> Result<VerifiedEk, TpmRefusal> {
        if chain.is_empty() || chain.len() > EK_CHAIN_CERTIFICATES_MAX {
            return Err(refusal(
                "TPM_MALFORMED",
                format!("an EK certificate chain holds 1 to {EK_CHAIN_CERTIFICATES_MAX} certificates"),
            ));
        }
        if chain.iter().any(|c| c.len() > EK_CERTIFICATE_BYTES_MAX) {
            return Err(refusal("TPM_MALFORMED", format!("a certificate is at most {EK_CERTIFICATE_BYTES_MAX} bytes")));
        }
        let parsed: Vec<X509Certificate<'_>> = chain
            .iter()
            .map(|der| match X509Certificate::from_der(der) {
                Ok(([], cert)) => Ok(cert),
                _ => Err(malformed("an EK chain's certificate")),
            })
            .collect::<Result<_, _>>()?;
        let anchors: Vec<X509Certificate<'_>> = self
            .certificates
            .iter()
            .map(|der| X509Certificate::from_der(der).map(|(_, c)| c).expect("checked at load"))
            .collect();
        let now = x509_parser::time::ASN1Time::from_timestamp(now_s).map_err(|_| malformed("the time"))?;
        let leaf = &parsed[0];
        let mut current = leaf;
        // Each step goes one certificate up; a chain of n certificates needs at most n steps.
        for _ in 0..chain.len() {
            if !current.validity().is_valid_at(now) {
                return Err(refusal("TPM_EK_UNTRUSTED", format!("the certificate {} is not valid now", current.subject())));
            }
            let algorithm = current.signature_algorithm.algorithm.to_id_string();
            if !CHAIN_SIGNATURE_ALGORITHMS.contains(&algorithm.as_str()) {
                return Err(refusal(
                    "TPM_EK_UNTRUSTED",
                    format!("the certificate {} is signed with {algorithm}, not RSA or ECDSA with SHA-2", current.subject()),
                ));
            }
            let signed_by = |issuer: &X509Certificate<'_>| {
                issuer.subject() == current.issuer()
                    && issuer.validity().is_valid_at(now)
                    && current.verify_signature(Some(issuer.public_key())).is_ok()
            };
            if anchors.iter().any(signed_by) {
                return verified_ek(leaf);
            }
            let is_ca = |c: &X509Certificate<'_>| c.basic_constraints().ok().flatten().is_some_and(|b| b.value.ca);
            match parsed[1..].iter().find(|c| is_ca(c) && signed_by(c)) {
                Some(next) => current = next,
                None => break,
            }
        }
        Err(refusal(
            "TPM_EK_UNTRUSTED",
            format!("the EK certificate (issuer {}) does not chain to the deployment's EK CA bundle", leaf.issuer()),
        ))
    }
}

/// The signature algorithms a certificate of an EK's chain may be signed with: RSA PKCS#1 v1.5
/// and RSASSA-PSS with SHA-2, and ECDSA with SHA-2 (x509-parser would also take SHA-1's, which
/// are refused: collisions for it are practical).
const CHAIN_SIGNATURE_ALGORITHMS: &[&str] = &[
    "1.2.840.113549.1.1.11", // sha256WithRSAEncryption
    "1.2.840.113549.1.1.12", // sha384WithRSAEncryption
    "1.2.840.113549.1.1.13", // sha512WithRSAEncryption
    "1.2.840.113549.1.1.10", // RSASSA-PSS
    "1.2.840.10045.4.3.2",   // ecdsa-with-SHA256
    "1.2.840.10045.4.3.3",   // ecdsa-with-SHA384
    "1.2.840.10045.4.3.4",   // ecdsa-with-SHA512
];

/// The bits of an EK's RSA modulus: MakeCredential here follows the RSA 2048 EK template
/// (SHA-256 names, AES-128 symmetric), so another size would fail later and misleadingly.
pub const EK_RSA_BITS: usize = 2048;

fn verified_ek(leaf: &X509Certificate<'_>) -> Result<VerifiedEk, TpmRefusal> {
    // An EK certificate certifies a TPM's key, never a CA's.
    if leaf.basic_constraints().ok().flatten().is_some_and(|b| b.value.ca) {
        return Err(refusal("TPM_EK_UNTRUSTED", "the EK certificate is a CA's certificate, not an endorsement key's"));
    }
    let spki = leaf.public_key();
    let public = match spki.parsed() {
        Ok(x509_parser::public_key::PublicKey::RSA(key)) if strip_zeros(key.modulus).len() * 8 == EK_RSA_BITS => {
            rsa_key(key.modulus, key.exponent, "the EK")?
        }
        _ => return Err(refusal("TPM_MALFORMED", "the EK certificate's key is not RSA 2048 (an RSA 2048 EK is taken)")),
    };
    Ok(VerifiedEk { spki_der: spki.raw.to_vec(), pin: pin_of(spki.raw), public })
}

/// An attestation key, from its `TPMT_PUBLIC`.
#[derive(Clone, Debug)]
pub struct AkPublic {
    /// `TPM_ALG_SHA256 ‖ SHA-256(TPMT_PUBLIC)`: the name MakeCredential binds the credential to.
    pub name: Vec<u8>,
    pub public: rsa::PublicKey,
}

impl AkPublic {
    /// Parses an AK's `TPMT_PUBLIC`: RSA, name algorithm SHA-256, a restricted signing key that
    /// does not decrypt and never left its TPM, scheme RSASSA with SHA-256 (or none), no
    /// symmetric algorithm.
    pub fn parse(bytes: &[u8]) -> Result<Self, TpmRefusal> {
        if bytes.len() > AK_PUBLIC_BYTES_MAX {
            return Err(refusal("TPM_MALFORMED", format!("an AK's public area is at most {AK_PUBLIC_BYTES_MAX} bytes")));
        }
        let mut r = Reader::new(bytes, "the AK's public area");
        let (kind, name_alg, attributes) = (r.u16()?, r.u16()?, r.u32()?);
        let _auth_policy = r.sized()?;
        if kind != TPM_ALG_RSA || name_alg != TPM_ALG_SHA256 {
            return Err(refusal("TPM_AK_UNFIT", "the AK is not an RSA key named with SHA-256"));
        }
        if attributes & AK_ATTRIBUTES_REQUIRED != AK_ATTRIBUTES_REQUIRED || attributes & ATTR_DECRYPT != 0 {
            return Err(refusal(
                "TPM_AK_UNFIT",
                format!(
                    "the AK's attributes {attributes:#010x} are not those of an attestation key (fixedTPM, fixedParent, sensitiveDataOrigin, restricted, sign; not decrypt)"
                ),
            ));
        }
        if r.u16()? != TPM_ALG_NULL {
            return Err(refusal("TPM_AK_UNFIT", "an AK has no symmetric algorithm"));
        }
        match r.u16()? {
            TPM_ALG_NULL => {}
            TPM_ALG_RSASSA if r.u16()? == TPM_ALG_SHA256 => {}
            _ => return Err(refusal("TPM_AK_UNFIT", "the AK's scheme is not RSASSA with SHA-256")),
        }
        let key_bits = r.u16()? as usize;
        let exponent = match r.u32()? {
            0 => 65537,
            e => e,
        };
        let modulus = r.sized()?;
        r.end()?;
        if modulus.len() * 8 != key_bits {
            return Err(malformed("the AK's public area"));
        }
        let public = rsa_key(modulus, &exponent.to_be_bytes(), "the AK")?;
        let mut name = TPM_ALG_SHA256.to_be_bytes().to_vec();
        name.extend_from_slice(&Sha256::digest(bytes));
        Ok(Self { name, public })
    }
}

/// KDFa (TPM 2.0 Part 1 §11.4.10.2) with HMAC-SHA256: `bits` of key from `key`, the label
/// (its NUL added) and the two contexts.
pub fn kdfa(key: &[u8], label: &str, context_u: &[u8], context_v: &[u8], bits: u32) -> Vec<u8> {
    use hmac::{KeyInit, Mac};
    let bytes = bits.div_ceil(8) as usize;
    let mut out = Vec::with_capacity(bytes + 32);
    let mut counter: u32 = 0;
    while out.len() < bytes {
        counter += 1;
        let mut mac = hmac::Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes keys of any length");
        mac.update(&counter.to_be_bytes());
        mac.update(label.as_bytes());
        mac.update(&[0]);
        mac.update(context_u);
        mac.update(context_v);
        mac.update(&bits.to_be_bytes());
        out.extend_from_slice(&mac.finalize().into_bytes());
    }
    out.truncate(bytes);
    out
}

/// AES-128 in CFB mode with a zero IV, as the TPM protects a credential; `decrypt` for the
/// way back (the tests' software TPM).
pub fn aes128_cfb(key: &[u8], data: &[u8], decrypt: bool) -> Vec<u8> {
    use aes::cipher::{BlockCipherEncrypt, KeyInit};
    let cipher = aes::Aes128::new_from_slice(key).expect("a 16-byte key");
    let mut feedback = aes::Block::default();
    let mut out = Vec::with_capacity(data.len());
    for chunk in data.chunks(16) {
        let mut stream = feedback;
        cipher.encrypt_block(&mut stream);
        let produced: Vec<u8> = chunk.iter().zip(stream.iter()).map(|(d, s)| d ^ s).collect();
        let ciphertext = if decrypt { chunk } else { &produced[..] };
        feedback[..ciphertext.len()].copy_from_slice(ciphertext);
        out.extend_from_slice(&produced);
    }
    out
}

/// A credential made for one TPM and one AK: what TPM2_ActivateCredential takes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MadeCredential {
    /// The `TPM2B_ID_OBJECT`'s contents: `TPM2B_DIGEST(HMAC) ‖ encIdentity`.
    pub credential_blob: Vec<u8>,
    /// The `TPM2B_ENCRYPTED_SECRET`'s contents: the seed under RSA-OAEP.
    pub encrypted_secret: Vec<u8>,
}

/// TPM2_MakeCredential in software: `credential` for the AK named `ak_name`, openable only by
/// the TPM holding `ek` (an RSA EK of the standard template: SHA-256, AES-128-CFB).
pub fn make_credential(
    ek: &rsa::PublicKey,
    ak_name: &[u8],
    credential: &[u8; CREDENTIAL_BYTES],
    rng: &mut (impl rsa::rand_core::CryptoRng + ?Sized),
) -> Result<MadeCredential, TpmRefusal> {
    let mut seed = [0u8; 32];
    rng.fill_bytes(&mut seed);
    let padding = rsa::Oaep::<Sha256>::new_with_label(IDENTITY_LABEL);
    let encrypted_secret =
        ek.encrypt(rng, padding, &seed).map_err(|e| refusal("TPM_MALFORMED", format!("sealing to the EK: {e}")))?;
    let (credential_blob, _) = wrap_credential(&seed, ak_name, credential);
    Ok(MadeCredential { credential_blob, encrypted_secret })
}

/// The credential blob for `seed`: the encrypted `TPM2B_DIGEST(credential)` behind its outer
/// HMAC; and the HMAC key (the software TPM of the tests checks with it).
fn wrap_credential(seed: &[u8], ak_name: &[u8], credential: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let symmetric_key = kdfa(seed, "STORAGE", ak_name, &[], 128);
    let mut plain = (credential.len() as u16).to_be_bytes().to_vec();
    plain.extend_from_slice(credential);
    let encrypted = aes128_cfb(&symmetric_key, &plain, false);
    let hmac_key = kdfa(seed, "INTEGRITY", &[], &[], 256);
    let outer = outer_hmac(&hmac_key, &encrypted, ak_name);
    let mut blob = (outer.len() as u16).to_be_bytes().to_vec();
    blob.extend_from_slice(&outer);
    blob.extend_from_slice(&encrypted);
    (blob, hmac_key)
}

/// The credential blob's outer HMAC: over the encrypted identity and the AK's name.
pub fn outer_hmac(hmac_key: &[u8], encrypted: &[u8], ak_name: &[u8]) -> Vec<u8> {
    use hmac::{KeyInit, Mac};
    let mut mac = hmac::Hmac::<Sha256>::new_from_slice(hmac_key).expect("HMAC takes keys of any length");
    mac.update(encrypted);
    mac.update(ak_name);
    mac.finalize().into_bytes().to_vec()
}

/// Whether the credential a machine gave back is the one made, in constant time.
pub fn check_credential(made: &[u8; CREDENTIAL_BYTES], returned: &[u8]) -> Result<(), TpmRefusal> {
    if returned.len() == made.len() && bc_core::webhook::constant_time_eq(made, returned) {
        Ok(())
    } else {
        Err(refusal(
            "TPM_CREDENTIAL",
            "the credential given back is not the one made for this EK and AK: the AK is not in the TPM whose EK certificate was sent",
        ))
    }
}

/// The `extraData` a join's quote must carry: SHA-256 over a domain tag, the gateway's nonce
/// and the node's Ed25519 key, so a quote answers one round of one join for one node key.
pub fn qualifying_data(nonce: &[u8; NONCE_BYTES], node_public_key: &[u8]) -> [u8; 32] {
    Sha256::new().chain_update(QUALIFYING_DATA_TAG).chain_update(nonce).chain_update(node_public_key).finalize().into()
}

/// SHA-256 over the PCR values in order: the quote's `pcrDigest` for those values.
pub fn pcr_digest(values: &[Vec<u8>]) -> [u8; 32] {
    let mut hash = Sha256::new();
    for value in values {
        hash.update(value);
    }
    hash.finalize().into()
}

/// A quote, parsed from its `TPMS_ATTEST`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quote {
    pub extra_data: Vec<u8>,
    /// The SHA-256 bank's PCRs it covers, ascending.
    pub pcrs: Vec<u32>,
    pub pcr_digest: Vec<u8>,
    /// The TPM's clock (ms), resets and restarts when it quoted: kept for the auditor.
    pub clock_ms: u64,
    pub reset_count: u32,
    pub restart_count: u32,
}

impl Quote {
    /// Parses a `TPMS_ATTEST` of type quote, over PCRs of the SHA-256 bank only.
    pub fn parse(attest: &[u8]) -> Result<Self, TpmRefusal> {
        if attest.len() > ATTEST_BYTES_MAX {
            return Err(refusal("TPM_MALFORMED", format!("a quote is at most {ATTEST_BYTES_MAX} bytes")));
        }
        let mut r = Reader::new(attest, "the quote");
        if r.u32()? != TPM_GENERATED_VALUE || r.u16()? != TPM_ST_ATTEST_QUOTE {
            return Err(refusal("TPM_MALFORMED", "the quote is not a TPM-generated quote"));
        }
        let _qualified_signer = r.sized()?;
        let extra_data = r.sized()?.to_vec();
        let (clock_ms, reset_count, restart_count, _safe) = (r.u64()?, r.u32()?, r.u32()?, r.u8()?);
        let _firmware_version = r.u64()?;
        let banks = r.u32()?;
        let mut pcrs = Vec::new();
        for _ in 0..banks.min(16) {
            let (hash, size) = (r.u16()?, r.u8()? as usize);
            let bitmap = r.take(size)?;
            for (byte_index, byte) in bitmap.iter().enumerate() {
                for bit in 0..8 {
                    if byte & (1 << bit) != 0 {
                        if hash != TPM_ALG_SHA256 {
                            return Err(refusal("TPM_MALFORMED", "the quote covers PCRs of a bank other than SHA-256"));
                        }
                        pcrs.push((byte_index * 8 + bit) as u32);
                    }
                }
            }
        }
        if banks > 16 {
            return Err(malformed("the quote's PCR selection"));
        }
        let pcr_digest = r.sized()?.to_vec();
        r.end()?;
        Ok(Self { extra_data, pcrs, pcr_digest, clock_ms, reset_count, restart_count })
    }

    /// Checks a quote (`attest`, its `TPMT_SIGNATURE`) against this round: its `extraData` is
    /// `qualifying_data`, it covers [`QUOTED_PCRS`], the AK signed it, and its PCR digest is that
    /// of `pcr_values` (one per quoted PCR, in order). The nonce is checked first: an old quote
    /// is refused as such (`TPM_QUOTE_NONCE`), whoever signed it.
    pub fn verify(
        attest: &[u8],
        signature: &[u8],
        ak: &AkPublic,
        qualifying_data: &[u8; 32],
        pcr_values: &[Vec<u8>],
    ) -> Result<Quote, TpmRefusal> {
        let quote = Self::parse(attest)?;
        if quote.extra_data != qualifying_data {
            return Err(refusal(
                "TPM_QUOTE_NONCE",
                "the quote was not made for this join's nonce (a replayed or another join's quote)",
            ));
        }
        if quote.pcrs != QUOTED_PCRS {
            return Err(refusal("TPM_MALFORMED", format!("the quote covers PCRs {:?}, not {:?}", quote.pcrs, QUOTED_PCRS)));
        }
        verify_signature(attest, signature, ak)?;
        if pcr_values.len() != QUOTED_PCRS.len() || pcr_values.iter().any(|v| v.len() != 32) {
            return Err(refusal("TPM_MALFORMED", format!("{} SHA-256 PCR values are sent with a quote", QUOTED_PCRS.len())));
        }
        if quote.pcr_digest != pcr_digest(pcr_values) {
            return Err(refusal("TPM_PCR_DIGEST", "the PCR values sent are not those the quote covers"));
        }
        Ok(quote)
    }
}

/// Checks a `TPMT_SIGNATURE` (RSASSA, SHA-256) by the AK over `attest`.
fn verify_signature(attest: &[u8], signature: &[u8], ak: &AkPublic) -> Result<(), TpmRefusal> {
    if signature.len() > SIGNATURE_BYTES_MAX {
        return Err(refusal("TPM_MALFORMED", format!("a signature is at most {SIGNATURE_BYTES_MAX} bytes")));
    }
    let mut r = Reader::new(signature, "the quote's signature");
    if r.u16()? != TPM_ALG_RSASSA || r.u16()? != TPM_ALG_SHA256 {
        return Err(refusal("TPM_QUOTE_SIGNATURE", "the quote is not signed with RSASSA and SHA-256"));
    }
    let bytes = r.sized()?;
    r.end()?;
    let digest = Sha256::digest(attest);
    ak.public
        .verify(rsa::Pkcs1v15Sign::new::<Sha256>(), &digest, bytes)
        .map_err(|_| refusal("TPM_QUOTE_SIGNATURE", "the quote's signature does not verify under the AK"))
}

/// The node a TPM joins as: the first 128 bits of SHA-256 over a domain tag and the EK's
/// SubjectPublicKeyInfo, as a ULID. The same TPM always names the same node, so a second join
/// of it finds the node's stream already there and is refused, never a new node.
pub fn node_id_of(ek_spki_der: &[u8]) -> bc_core::id::NodeId {
    let digest = Sha256::new().chain_update(b"better-compute/tpm-node-id/v1\n").chain_update(ek_spki_der).finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    bc_core::id::NodeId::from_ulid(ulid::Ulid::from_bytes(bytes))
}

#[cfg(test)]
mod tests;
