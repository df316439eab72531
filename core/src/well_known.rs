//! The well-known document (`GET /.well-known/better-compute`, docs/admission.md) and the join
//! token sealed to the deployment's join encryption key: the bytes both sides compute alike.
//!
//! - The **document** names the agents' endpoint, the pin of its serving certificate, the log
//!   key's pin, the **join signing key** (Ed25519, RFC 8037 JWK) and the **join encryption key**
//!   (X25519, RFC 8037 JWK). It is signed by the join signing key over
//!   [`WELL_KNOWN_SIGNATURE_CONTEXT`] followed by the RFC 8785 (JCS) canonical JSON of the
//!   document without its `signature` member ([`canonical_json`]); the signature is the
//!   `signature` member, base64url without padding.
//! - The **join token** is sealed with HPKE (RFC 9180, base mode) to the join encryption key:
//!   DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, ChaCha20Poly1305 ([`HPKE_SUITE`]), `info`
//!   [`JOIN_TOKEN_SEAL_INFO`], and the joining node's Ed25519 public key as the associated data,
//!   so a sealed token lifted off the wire opens only in a join for that node's key.
//! - Every `JoinResponse` is signed by the join signing key over
//!   [`join_response_signing_message`].
//!
//! Pins are those of the rest of the workspace: `sha256/` and the standard base64 of SHA-256 over
//! the raw 32-byte public key for these two keys (as the log key's, [`crate::keys::pin_of`]), and
//! over the certificate's SubjectPublicKeyInfo for the serving certificate (`bc_pin::spki_pin`).
//! Nothing here draws randomness: the caller passes its RNG.

use base64::Engine;
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use hpke::{Deserializable, Kem as _, OpModeR, OpModeS, Serializable};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// Where the document is served, on the API's address.
pub const WELL_KNOWN_PATH: &str = "/.well-known/better-compute";
/// The document's format (`version`); another is refused.
pub const WELL_KNOWN_VERSION: u64 = 1;
/// The largest document read (a document is about 1 KiB).
pub const WELL_KNOWN_BYTES_MAX: usize = 16 * 1024;
/// The longest agents' URL a document names.
pub const AGENTS_URL_BYTES_MAX: usize = 512;
/// What the document's signature covers, before its canonical JSON.
pub const WELL_KNOWN_SIGNATURE_CONTEXT: &[u8] = b"better-compute/well-known/v1\n";
/// What a `JoinResponse`'s join signature covers first.
pub const JOIN_RESPONSE_SIGNATURE_CONTEXT: &[u8] = b"better-compute/join-response/v1\n";
/// HPKE's `info` for a sealed join token.
pub const JOIN_TOKEN_SEAL_INFO: &[u8] = b"better-compute/join-token/v1";
/// The HPKE suite, as the document names it: RFC 9180's identifiers.
pub const HPKE_KEM_ID: u16 = 0x0020;
pub const HPKE_KDF_ID: u16 = 0x0001;
pub const HPKE_AEAD_ID: u16 = 0x0003;
pub const HPKE_SUITE: &str = "DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, ChaCha20Poly1305";
/// An encapsulated key (X25519's public value).
pub const SEALED_ENC_BYTES: usize = 32;
/// ChaCha20Poly1305's tag.
pub const SEALED_TAG_BYTES: usize = 16;
/// The largest sealed token: the largest token and the tag.
pub const SEALED_TOKEN_BYTES_MAX: usize = crate::agent::JOIN_TOKEN_BYTES_MAX + SEALED_TAG_BYTES;
/// The longest pin (`sha256/` and 44 characters of base64).
pub const PIN_BYTES_MAX: usize = 64;

type Kem = hpke::kem::X25519HkdfSha256;
type Kdf = hpke::kdf::HkdfSha256;
type Aead = hpke::aead::ChaCha20Poly1305;

fn pin_of_bytes(bytes: &[u8]) -> String {
    format!("sha256/{}", base64::engine::general_purpose::STANDARD.encode(Sha256::digest(bytes)))
}

fn b64url(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

fn unb64url(text: &str) -> Result<Vec<u8>, String> {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(text).map_err(|_| "not base64url without padding".to_owned())
}

/// The pin of an X25519 join encryption key: `sha256/` + base64 of SHA-256 over its 32 bytes.
pub fn encryption_pin(public: &[u8; 32]) -> String {
    pin_of_bytes(public)
}

/// The pin of the join signing key (as the log key's).
pub fn signing_pin(public: &VerifyingKey) -> String {
    crate::keys::pin_of(public)
}

/// An X25519 public key as a JWK (RFC 7517, RFC 8037 §2), its pin as `kid`.
pub fn x25519_jwk(public: &[u8; 32]) -> Value {
    serde_json::json!({ "kty": "OKP", "crv": "X25519", "x": b64url(public), "kid": encryption_pin(public), "use": "enc" })
}

/// An Ed25519 public key as a JWK (RFC 8037 §2), its pin as `kid`.
pub fn ed25519_jwk(public: &VerifyingKey) -> Value {
    serde_json::json!({ "kty": "OKP", "crv": "Ed25519", "x": b64url(public.as_bytes()), "kid": signing_pin(public), "use": "sig" })
}

/// The 32 bytes of an OKP JWK of curve `crv`, checked (`kty`, `crv`, `x`; a `kid` must be the
/// key's pin).
fn okp_jwk_bytes(jwk: &Value, crv: &str) -> Result<[u8; 32], String> {
    let field = |name: &str| jwk.get(name).and_then(Value::as_str);
    if !jwk.is_object() || field("kty") != Some("OKP") || field("crv") != Some(crv) {
        return Err(format!("not an OKP JWK of curve {crv}"));
    }
    let x = unb64url(field("x").ok_or("the JWK has no x")?).map_err(|e| format!("the JWK's x: {e}"))?;
    let x: [u8; 32] = x.try_into().map_err(|_| "the JWK's x is not 32 bytes".to_owned())?;
    if let Some(kid) = jwk.get("kid")
        && kid.as_str() != Some(&pin_of_bytes(&x))
    {
        return Err("the JWK's kid is not its key's pin".into());
    }
    Ok(x)
}

/// The X25519 key of a join encryption JWK (`join-encryption.jwk`).
pub fn parse_x25519_jwk(jwk: &Value) -> Result<[u8; 32], String> {
    let x = okp_jwk_bytes(jwk, "X25519")?;
    <Kem as hpke::Kem>::PublicKey::from_bytes(&x).map_err(|_| "not an X25519 public key".to_owned())?;
    Ok(x)
}

/// The Ed25519 key of a join signing JWK.
pub fn parse_ed25519_jwk(jwk: &Value) -> Result<VerifyingKey, String> {
    let x = okp_jwk_bytes(jwk, "Ed25519")?;
    VerifyingKey::from_bytes(&x).map_err(|_| "not an Ed25519 public key".to_owned())
}

/// The deployment's join encryption key (its private half: the gateway's alone).
#[derive(Clone)]
pub struct JoinEncryptionKey {
    private: <Kem as hpke::Kem>::PrivateKey,
    public: [u8; 32],
}

impl std::fmt::Debug for JoinEncryptionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JoinEncryptionKey").field("pin", &self.pin()).finish_non_exhaustive()
    }
}

impl JoinEncryptionKey {
    /// The key derived from 32 secret bytes (RFC 9180 `DeriveKeyPair`).
    pub fn from_secret(ikm: &[u8; 32]) -> Self {
        let (private, public) = Kem::derive_keypair(ikm);
        let public: [u8; 32] = public.to_bytes().as_slice().try_into().expect("an X25519 public key is 32 bytes");
        Self { private, public }
    }

    pub fn public(&self) -> &[u8; 32] {
        &self.public
    }

    pub fn pin(&self) -> String {
        encryption_pin(&self.public)
    }

    pub fn jwk(&self) -> Value {
        x25519_jwk(&self.public)
    }

    /// Opens a token sealed to this key for `node_public_key` ([`seal_join_token`]).
    pub fn open(&self, sealed: &SealedToken, node_public_key: &[u8]) -> Result<Vec<u8>, String> {
        if sealed.enc.len() != SEALED_ENC_BYTES {
            return Err(format!("a sealed token's encapsulated key is {SEALED_ENC_BYTES} bytes"));
        }
        if sealed.ciphertext.len() < SEALED_TAG_BYTES || sealed.ciphertext.len() > SEALED_TOKEN_BYTES_MAX {
            return Err(format!("a sealed token is {SEALED_TAG_BYTES} to {SEALED_TOKEN_BYTES_MAX} bytes"));
        }
        let enc = <Kem as hpke::Kem>::EncappedKey::from_bytes(&sealed.enc)
            .map_err(|_| "the sealed token's encapsulated key is not an X25519 key".to_owned())?;
        hpke::single_shot_open::<Aead, Kdf, Kem>(
            &OpModeR::Base,
            &self.private,
            &enc,
            JOIN_TOKEN_SEAL_INFO,
            &sealed.ciphertext,
            node_public_key,
        )
        .map_err(|_| "the sealed token does not open with this deployment's join encryption key".to_owned())
    }
}

/// A join token sealed with HPKE: the encapsulated key and the ciphertext (with its tag).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SealedToken {
    pub enc: Vec<u8>,
    pub ciphertext: Vec<u8>,
}

/// Seals `token` to the join encryption key `public` for a join by `node_public_key` (the
/// associated data).
pub fn seal_join_token(
    public: &[u8; 32],
    token: &[u8],
    node_public_key: &[u8],
    rng: &mut impl hpke::rand_core::CryptoRng,
) -> Result<SealedToken, String> {
    if token.len() > crate::agent::JOIN_TOKEN_BYTES_MAX {
        return Err(format!("a join token is at most {} bytes", crate::agent::JOIN_TOKEN_BYTES_MAX));
    }
    let recipient = <Kem as hpke::Kem>::PublicKey::from_bytes(public).map_err(|_| "not an X25519 public key".to_owned())?;
    let (enc, ciphertext) = hpke::single_shot_seal_with_rng::<Aead, Kdf, Kem>(
        &OpModeS::Base,
        &recipient,
        JOIN_TOKEN_SEAL_INFO,
        token,
        node_public_key,
        rng,
    )
    .map_err(|e| format!("sealing the join token: {e}"))?;
    Ok(SealedToken { enc: enc.to_bytes().to_vec(), ciphertext })
}

/// The HPKE suite as the document names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HpkeSuite {
    pub kem_id: u16,
    pub kdf_id: u16,
    pub aead_id: u16,
    pub name: String,
}

impl HpkeSuite {
    pub fn ours() -> Self {
        Self { kem_id: HPKE_KEM_ID, kdf_id: HPKE_KDF_ID, aead_id: HPKE_AEAD_ID, name: HPKE_SUITE.to_owned() }
    }
}

/// The document's members (without `signature`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WellKnown {
    pub version: u64,
    /// The agents' endpoint as agents reach it (`https://HOST:PORT`; `http://` only to loopback).
    pub agents_url: String,
    /// The pin of the agents' serving certificate's key (`serving_ca_spki_pin`); none for a
    /// loopback h2c `dev` endpoint.
    pub serving_ca_pin: Option<String>,
    /// The log key's pin (`log_key_pin`): the key that signs node identities.
    pub log_key_pin: String,
    pub join_signing_key: Value,
    pub join_signing_pin: String,
    pub join_encryption_key: Value,
    pub join_encryption_pin: String,
    pub join_encryption_suite: HpkeSuite,
}

/// Why a document is refused: a stable code and what to say.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct WellKnownError {
    /// `WELL_KNOWN_TOO_LARGE`, `WELL_KNOWN_MALFORMED`, `WELL_KNOWN_BAD_SIGNATURE`,
    /// `WELL_KNOWN_UNSUPPORTED`, `PIN_MISMATCH`, `WELL_KNOWN_FETCH`.
    pub code: &'static str,
    pub message: String,
}

impl WellKnownError {
    pub fn new(code: &'static str, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }
}

fn malformed(message: impl Into<String>) -> WellKnownError {
    WellKnownError::new("WELL_KNOWN_MALFORMED", message)
}

/// RFC 8785 (JCS) canonical JSON of `value`: members sorted by their names' UTF-16 code units,
/// no whitespace, strings escaped as ECMAScript does (serde_json's escaping is the same), and
/// integers only (a document with a fractional number is refused, so no float formatting is
/// involved).
pub fn canonical_json(value: &Value) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    write_canonical(value, &mut out)?;
    Ok(out)
}

fn write_canonical(value: &Value, out: &mut Vec<u8>) -> Result<(), String> {
    match value {
        Value::Null | Value::Bool(_) | Value::String(_) => {
            serde_json::to_writer(&mut *out, value).map_err(|e| e.to_string())?;
        }
        Value::Number(n) => {
            if !(n.is_i64() || n.is_u64()) {
                return Err("a canonical document holds integers only".into());
            }
            serde_json::to_writer(&mut *out, n).map_err(|e| e.to_string())?;
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(item, out)?;
            }
            out.push(b']');
        }
        Value::Object(members) => {
            let mut sorted: Vec<(&String, &Value)> = members.iter().collect();
            sorted.sort_by(|a, b| a.0.encode_utf16().cmp(b.0.encode_utf16()));
            out.push(b'{');
            for (i, (name, member)) in sorted.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                serde_json::to_writer(&mut *out, name).map_err(|e| e.to_string())?;
                out.push(b':');
                write_canonical(member, out)?;
            }
            out.push(b'}');
        }
    }
    Ok(())
}

/// The bytes the document's signature covers: the context, then the canonical JSON of the
/// document without `signature`.
pub fn document_signing_message(unsigned: &Value) -> Result<Vec<u8>, String> {
    Ok([WELL_KNOWN_SIGNATURE_CONTEXT, &canonical_json(unsigned)?].concat())
}

/// The document served: `document`'s members and `signature`, by `key` (the join signing key).
pub fn sign_document(document: &WellKnown, key: &SigningKey) -> Result<Vec<u8>, String> {
    let mut value = serde_json::to_value(document).map_err(|e| e.to_string())?;
    let signature = key.sign(&document_signing_message(&value)?);
    value["signature"] = Value::String(b64url(&signature.to_bytes()));
    serde_json::to_vec_pretty(&value).map_err(|e| e.to_string())
}

/// A document read, checked whole: its size, its form, its signature by the join signing key it
/// names, each key's pin as stated, its version and suite. What pins the reader holds is the
/// reader's to check ([`WellKnown::check_pins`]).
pub fn verify_document(bytes: &[u8]) -> Result<(WellKnown, VerifyingKey), WellKnownError> {
    if bytes.len() > WELL_KNOWN_BYTES_MAX {
        return Err(WellKnownError::new("WELL_KNOWN_TOO_LARGE", format!("the document is over {WELL_KNOWN_BYTES_MAX} bytes")));
    }
    let mut value: Value = serde_json::from_slice(bytes).map_err(|e| malformed(format!("not JSON: {e}")))?;
    let members = value.as_object_mut().ok_or_else(|| malformed("not a JSON object"))?;
    let signature = members.remove("signature").ok_or_else(|| malformed("it has no signature"))?;
    let signature = signature.as_str().ok_or_else(|| malformed("its signature is not a string"))?;
    let signature = Signature::from_slice(&unb64url(signature).map_err(|e| malformed(format!("its signature: {e}")))?)
        .map_err(|_| malformed("its signature is not 64 bytes"))?;
    let version = value.get("version").and_then(Value::as_u64);
    if version != Some(WELL_KNOWN_VERSION) {
        return Err(WellKnownError::new(
            "WELL_KNOWN_UNSUPPORTED",
            format!("the document's version is {version:?}; this bcd reads version {WELL_KNOWN_VERSION}"),
        ));
    }
    let signing_key = parse_ed25519_jwk(value.get("joinSigningKey").unwrap_or(&Value::Null))
        .map_err(|e| malformed(format!("joinSigningKey: {e}")))?;
    let message = document_signing_message(&value).map_err(malformed)?;
    signing_key.verify_strict(&message, &signature).map_err(|_| {
        WellKnownError::new("WELL_KNOWN_BAD_SIGNATURE", "the document's signature does not verify against its join signing key")
    })?;
    let document: WellKnown = serde_json::from_value(value).map_err(|e| malformed(e.to_string()))?;
    let encryption_key =
        parse_x25519_jwk(&document.join_encryption_key).map_err(|e| malformed(format!("joinEncryptionKey: {e}")))?;
    if document.join_signing_pin != signing_pin(&signing_key) || document.join_encryption_pin != encryption_pin(&encryption_key) {
        return Err(malformed("a pin the document states is not its key's"));
    }
    if document.join_encryption_suite.kem_id != HPKE_KEM_ID
        || document.join_encryption_suite.kdf_id != HPKE_KDF_ID
        || document.join_encryption_suite.aead_id != HPKE_AEAD_ID
    {
        return Err(WellKnownError::new("WELL_KNOWN_UNSUPPORTED", format!("the document's HPKE suite is not {HPKE_SUITE}")));
    }
    if document.agents_url.is_empty() || document.agents_url.len() > AGENTS_URL_BYTES_MAX {
        return Err(malformed(format!("agentsUrl is 1 to {AGENTS_URL_BYTES_MAX} bytes")));
    }
    Ok((document, signing_key))
}

/// The pins a joining machine holds, each checked against the document when given.
#[derive(Clone, Debug, Default)]
pub struct HeldPins<'a> {
    pub serving_ca: Option<&'a str>,
    pub join_signing: Option<&'a str>,
    pub join_encryption: Option<&'a str>,
}

impl WellKnown {
    /// The join encryption key (checked by [`verify_document`]).
    pub fn encryption_key(&self) -> Result<[u8; 32], String> {
        parse_x25519_jwk(&self.join_encryption_key)
    }

    /// Each held pin against the document: `PIN_MISMATCH` naming the first that differs.
    pub fn check_pins(&self, held: &HeldPins<'_>) -> Result<(), WellKnownError> {
        let checks = [
            ("--serving-ca-pin", "servingCaPin", held.serving_ca, self.serving_ca_pin.as_deref()),
            ("--join-signing-pin", "joinSigningPin", held.join_signing, Some(self.join_signing_pin.as_str())),
            ("--join-encryption-pin", "joinEncryptionPin", held.join_encryption, Some(self.join_encryption_pin.as_str())),
        ];
        for (flag, member, held, stated) in checks {
            if let Some(held) = held
                && Some(held) != stated
            {
                return Err(WellKnownError::new(
                    "PIN_MISMATCH",
                    format!("the document's {member} is {}, not {flag} {held}", stated.unwrap_or("absent")),
                ));
            }
        }
        Ok(())
    }
}

/// The bytes a `JoinResponse`'s join signature covers: the context, then each field as a
/// 4-byte big-endian length and its bytes (the identity, its log signature, the log key, the
/// node certificate, the CA certificate), then the certificate's end as 8 bytes big-endian.
pub fn join_response_signing_message(
    identity: &[u8],
    identity_signature: &[u8],
    log_public_key: &[u8],
    node_certificate: &[u8],
    node_ca_certificate: &[u8],
    node_certificate_not_after_ms: u64,
) -> Vec<u8> {
    let mut message = JOIN_RESPONSE_SIGNATURE_CONTEXT.to_vec();
    for field in [identity, identity_signature, log_public_key, node_certificate, node_ca_certificate] {
        message.extend_from_slice(&(field.len() as u32).to_be_bytes());
        message.extend_from_slice(field);
    }
    message.extend_from_slice(&node_certificate_not_after_ms.to_be_bytes());
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A seeded RNG: tests only.
    fn rng() -> rand::rngs::StdRng {
        rand::SeedableRng::seed_from_u64(7)
    }

    fn document(key: &SigningKey, encryption: &JoinEncryptionKey) -> WellKnown {
        WellKnown {
            version: WELL_KNOWN_VERSION,
            agents_url: "https://127.0.0.1:7443".into(),
            serving_ca_pin: Some("sha256/AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=".into()),
            log_key_pin: "sha256/BBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB=".into(),
            join_signing_key: ed25519_jwk(&key.verifying_key()),
            join_signing_pin: signing_pin(&key.verifying_key()),
            join_encryption_key: encryption.jwk(),
            join_encryption_pin: encryption.pin(),
            join_encryption_suite: HpkeSuite::ours(),
        }
    }

    #[test]
    fn a_sealed_token_opens_for_its_node_key_only_and_a_tampered_one_is_refused() {
        let key = JoinEncryptionKey::from_secret(&[3; 32]);
        let token = b"bcjt_jt_01JAAAAAAAAAAAAAAAAAAAAAAA_secret";
        let node = [9u8; 32];
        let sealed = seal_join_token(key.public(), token, &node, &mut rng()).unwrap();
        assert_eq!(sealed.enc.len(), SEALED_ENC_BYTES);
        assert_eq!(sealed.ciphertext.len(), token.len() + SEALED_TAG_BYTES);
        assert!(!sealed.ciphertext.windows(token.len()).any(|w| w == token), "the token is not in the clear");
        assert_eq!(key.open(&sealed, &node).unwrap(), token);
        // Another node's key (the associated data) does not open it.
        assert!(key.open(&sealed, &[8u8; 32]).is_err());
        // A flipped bit anywhere is refused.
        for at in 0..sealed.ciphertext.len() {
            let mut tampered = sealed.clone();
            tampered.ciphertext[at] ^= 1;
            assert!(key.open(&tampered, &node).is_err(), "a flip at {at} is refused");
        }
        let mut tampered = sealed.clone();
        tampered.enc[0] ^= 1;
        assert!(key.open(&tampered, &node).is_err(), "a changed encapsulated key is refused");
        // Another deployment's key does not open it.
        assert!(JoinEncryptionKey::from_secret(&[4; 32]).open(&sealed, &node).is_err());
        // Bounds.
        let mut short = sealed.clone();
        short.enc.pop();
        assert!(key.open(&short, &node).unwrap_err().contains("32 bytes"));
        assert!(seal_join_token(key.public(), &[b'a'; crate::agent::JOIN_TOKEN_BYTES_MAX + 1], &node, &mut rng()).is_err());
    }

    #[test]
    fn a_signed_document_verifies_and_one_changed_or_signed_by_another_key_does_not() {
        let key = SigningKey::from_bytes(&[1; 32]);
        let encryption = JoinEncryptionKey::from_secret(&[2; 32]);
        let signed = sign_document(&document(&key, &encryption), &key).unwrap();
        let (read, signer) = verify_document(&signed).unwrap();
        assert_eq!(read, document(&key, &encryption));
        assert_eq!(signer, key.verifying_key());
        assert_eq!(read.encryption_key().unwrap(), *encryption.public());

        // One member changed after signing: the signature no longer verifies.
        let mut value: Value = serde_json::from_slice(&signed).unwrap();
        value["agentsUrl"] = "https://evil.example:7443".into();
        let changed = serde_json::to_vec(&value).unwrap();
        assert_eq!(verify_document(&changed).unwrap_err().code, "WELL_KNOWN_BAD_SIGNATURE");
        // A bad signature (one bit flipped).
        let mut value: Value = serde_json::from_slice(&signed).unwrap();
        let mut signature = unb64url(value["signature"].as_str().unwrap()).unwrap();
        signature[5] ^= 1;
        value["signature"] = b64url(&signature).into();
        assert_eq!(verify_document(&serde_json::to_vec(&value).unwrap()).unwrap_err().code, "WELL_KNOWN_BAD_SIGNATURE");
        // Signed by another key than the one it names: refused (an attacker swapping in its own
        // signing key must also match the pin, checked below).
        let other = SigningKey::from_bytes(&[5; 32]);
        let mut forged = document(&key, &encryption);
        forged.join_encryption_key = JoinEncryptionKey::from_secret(&[6; 32]).jwk();
        let forged = sign_document(&forged, &other).unwrap();
        assert!(verify_document(&forged).is_err());
        // Re-signed whole by another key: it verifies, but not against the held pin.
        let resigned = sign_document(&document(&other, &encryption), &other).unwrap();
        let (read, _) = verify_document(&resigned).unwrap();
        let held = HeldPins { join_signing: Some(&document(&key, &encryption).join_signing_pin), ..Default::default() };
        let refused = read.check_pins(&held).unwrap_err();
        assert_eq!(refused.code, "PIN_MISMATCH");
        assert!(refused.message.contains("--join-signing-pin"), "{refused}");
        // Whitespace and member order do not matter: the signature covers the canonical form.
        let value: Value = serde_json::from_slice(&signed).unwrap();
        assert!(verify_document(&serde_json::to_vec(&value).unwrap()).is_ok());
        // Bounds and form.
        assert_eq!(verify_document(&vec![b' '; WELL_KNOWN_BYTES_MAX + 1]).unwrap_err().code, "WELL_KNOWN_TOO_LARGE");
        assert_eq!(verify_document(b"[]").unwrap_err().code, "WELL_KNOWN_MALFORMED");
        let mut unsigned: Value = serde_json::from_slice(&signed).unwrap();
        unsigned.as_object_mut().unwrap().remove("signature");
        assert_eq!(verify_document(&serde_json::to_vec(&unsigned).unwrap()).unwrap_err().code, "WELL_KNOWN_MALFORMED");
    }

    #[test]
    fn held_pins_are_checked_one_by_one() {
        let key = SigningKey::from_bytes(&[1; 32]);
        let encryption = JoinEncryptionKey::from_secret(&[2; 32]);
        let doc = document(&key, &encryption);
        let good = HeldPins {
            serving_ca: doc.serving_ca_pin.as_deref(),
            join_signing: Some(&doc.join_signing_pin),
            join_encryption: Some(&doc.join_encryption_pin),
        };
        doc.check_pins(&good).unwrap();
        doc.check_pins(&HeldPins::default()).unwrap();
        let wrong = "sha256/CCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCC=";
        for held in [
            HeldPins { serving_ca: Some(wrong), ..good.clone() },
            HeldPins { join_signing: Some(wrong), ..good.clone() },
            HeldPins { join_encryption: Some(wrong), ..good.clone() },
        ] {
            assert_eq!(doc.check_pins(&held).unwrap_err().code, "PIN_MISMATCH");
        }
    }

    #[test]
    fn canonical_json_sorts_members_and_refuses_fractions() {
        let value: Value = serde_json::from_str(r#"{ "b": [1, {"z": null, "a": true}], "a": "\u0001é/" }"#).unwrap();
        assert_eq!(
            String::from_utf8(canonical_json(&value).unwrap()).unwrap(),
            r#"{"a":"\u0001é/","b":[1,{"a":true,"z":null}]}"#
        );
        assert!(canonical_json(&serde_json::json!({ "a": 1.5 })).is_err());
    }

    #[test]
    fn a_jwk_is_rfc_8037_and_its_kid_is_its_pin() {
        let key = JoinEncryptionKey::from_secret(&[2; 32]);
        let jwk = key.jwk();
        assert_eq!(jwk["kty"], "OKP");
        assert_eq!(jwk["crv"], "X25519");
        assert_eq!(unb64url(jwk["x"].as_str().unwrap()).unwrap(), key.public());
        assert_eq!(parse_x25519_jwk(&jwk).unwrap(), *key.public());
        let mut wrong_kid = jwk.clone();
        wrong_kid["kid"] = "sha256/x".into();
        assert!(parse_x25519_jwk(&wrong_kid).is_err());
        let mut ed = jwk.clone();
        ed["crv"] = "Ed25519".into();
        assert!(parse_x25519_jwk(&ed).is_err());
    }

    #[test]
    fn the_join_response_message_frames_each_field() {
        let a = join_response_signing_message(b"ab", b"c", b"", b"", b"", 1);
        let b = join_response_signing_message(b"a", b"bc", b"", b"", b"", 1);
        assert_ne!(a, b, "moving a byte between fields changes the message");
        assert!(a.starts_with(JOIN_RESPONSE_SIGNATURE_CONTEXT));
    }
}
