//! Webhook signing (Standard Webhooks) and the receiver-URL policy. Pure: no IO.
//!
//! A delivery carries `webhook-id` (the message id, the same on every retry), `webhook-timestamp`
//! (Unix seconds of this attempt) and `webhook-signature`: space-separated `v1,BASE64` HMAC-SHA256
//! signatures over `{id}.{timestamp}.{body}`, one per secret in use (two while a rotated-out
//! secret is still honoured). Secrets are `whsec_` followed by the base64 of 32 random bytes.
//!
//! The URL policy keeps deliveries out of the operator's network (server-side request forgery):
//! `https://` only, except `http://` to loopback where the deployment allows loopback (`dev`);
//! loopback and private addresses only where the deployment allows them; never link-local (the
//! cloud metadata service lives there), unspecified, multicast, broadcast or documentation ranges. The gateway checks a URL's text
//! when it is saved; the deliverer checks every address the name resolves to, at delivery time,
//! and connects only to an address it checked.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use base64::Engine;
use hmac::{KeyInit, Mac};

use crate::error::{Error, Result};

pub const SECRET_PREFIX: &str = "whsec_";
/// Random bytes in a generated secret.
pub const SECRET_BYTES: usize = 32;
/// Longest receiver URL.
pub const URL_BYTES_MAX: usize = 2048;
/// How far a receiver should accept a timestamp from its own clock (the spec's suggestion).
pub const TIMESTAMP_TOLERANCE_S: u64 = 300;

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// A signing secret: `whsec_` + base64 of the key bytes.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(…)")
    }
}

impl Secret {
    /// A new signing secret from the OS's randomness, never a seed.
    #[allow(clippy::disallowed_methods)]
    pub fn generate() -> Self {
        Self(rand::random::<[u8; SECRET_BYTES]>().to_vec())
    }

    pub fn parse(text: &str) -> Result<Self> {
        let b64 = text.trim().strip_prefix(SECRET_PREFIX).ok_or_else(|| Error::invalid("a webhook secret starts with whsec_"))?;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|_| Error::invalid("a webhook secret is whsec_ followed by base64"))?;
        if !(24..=64).contains(&bytes.len()) {
            return Err(Error::invalid("a webhook secret holds 24 to 64 bytes"));
        }
        Ok(Self(bytes))
    }

    /// The text form, `whsec_…`. It is a secret: show it once, never log it.
    pub fn expose(&self) -> String {
        format!("{SECRET_PREFIX}{}", base64::engine::general_purpose::STANDARD.encode(&self.0))
    }

    /// `v1,BASE64` over `{id}.{timestamp}.{body}`.
    pub fn sign(&self, msg_id: &str, timestamp_s: u64, body: &[u8]) -> String {
        let mut mac = HmacSha256::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        mac.update(msg_id.as_bytes());
        mac.update(b".");
        mac.update(timestamp_s.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        format!("v1,{}", base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes()))
    }
}

/// The `webhook-signature` header value: one signature per secret.
pub fn signature_header(secrets: &[Secret], msg_id: &str, timestamp_s: u64, body: &[u8]) -> String {
    secrets.iter().map(|s| s.sign(msg_id, timestamp_s, body)).collect::<Vec<_>>().join(" ")
}

/// What a receiver does: true when any `v1` signature in `header` is `secret`'s over the message,
/// compared in constant time, and the timestamp is within the tolerance of `now_s`.
pub fn verify(secret: &Secret, msg_id: &str, timestamp_s: u64, body: &[u8], header: &str, now_s: u64) -> bool {
    if now_s.abs_diff(timestamp_s) > TIMESTAMP_TOLERANCE_S {
        return false;
    }
    let mut mac = HmacSha256::new_from_slice(&secret.0).expect("HMAC takes keys of any length");
    mac.update(format!("{msg_id}.{timestamp_s}.").as_bytes());
    mac.update(body);
    let expected = mac.finalize().into_bytes();
    header.split(' ').filter_map(|sig| sig.strip_prefix("v1,")).any(|b64| {
        base64::engine::general_purpose::STANDARD
            .decode(b64)
            .is_ok_and(|given| given.len() == expected.len() && constant_time_eq(&given, &expected))
    })
}

pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Which receivers a deployment may deliver to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EndpointPolicy {
    /// `http://` and addresses on loopback (`dev`, tests).
    pub allow_loopback: bool,
    /// Private addresses (RFC 1918, unique-local, CGNAT). Link-local (and with it the cloud
    /// metadata service) stays refused.
    pub allow_private: bool,
}

/// What an address is, for the policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AddressClass {
    Public,
    Loopback,
    Private,
    /// Never a receiver: unspecified, multicast, broadcast, documentation, reserved.
    Forbidden,
}

pub fn classify(ip: IpAddr) -> AddressClass {
    match ip {
        IpAddr::V4(v4) => classify_v4(v4),
        IpAddr::V6(v6) => classify_v6(v6),
    }
}

/// The stricter of two classes: what an address is when it is both (an IPv6 address and the
/// IPv4 address it carries). Loopback and private together are refused.
fn stricter(a: AddressClass, b: AddressClass) -> AddressClass {
    use AddressClass::*;
    match (a, b) {
        (x, y) if x == y => x,
        (Public, other) | (other, Public) => other,
        _ => Forbidden,
    }
}

/// Every IPv6 form that carries an IPv4 address is checked against the IPv4 rules:
/// - IPv4-mapped `::ffff:0:0/96` and IPv4-translated `::ffff:0:0:0/96` (RFC 6145) reach the
///   IPv4 address itself: they are what it is;
/// - NAT64 (`64:ff9b::/96`, the local-use `64:ff9b:1::/48` of RFC 8215 and the rest of
///   `64:ff9b::/32`), 6to4 `2002::/16`, Teredo `2001::/32` and IPv4-compatible `::/96` reach it
///   through a translator or a tunnel the policy cannot see: refused, whatever they carry;
/// - ISATAP interface identifiers (`::0:5efe:a.b.c.d`, `::200:5efe:a.b.c.d`, RFC 5214) under any
///   prefix are at least what the IPv4 address they carry is.
fn classify_v6(v6: Ipv6Addr) -> AddressClass {
    let segments = v6.segments();
    let [seg0, seg1, ..] = segments;
    let embedded = |hi: u16, lo: u16| Ipv4Addr::from((u32::from(hi) << 16) | u32::from(lo));
    if let Some(v4) = v6.to_ipv4_mapped() {
        return classify_v4(v4);
    }
    if segments[..6] == [0, 0, 0, 0, 0xffff, 0] {
        return classify_v4(embedded(segments[6], segments[7]));
    }
    let class = if v6.is_loopback() {
        AddressClass::Loopback
    } else if v6.is_unspecified()
        || v6.is_multicast()
        || (seg0, seg1) == (0x2001, 0x0db8)
        // Link-local and the old site-local: the instance-metadata neighbourhood.
        || (seg0 & 0xffc0) == 0xfe80
        || (seg0 & 0xffc0) == 0xfec0
        // AWS's IPv6 instance metadata service.
        || v6 == Ipv6Addr::new(0xfd00, 0x0ec2, 0, 0, 0, 0, 0, 0x0254)
        // Translated or tunnelled IPv4: NAT64 (well-known and local-use), Teredo, 6to4,
        // IPv4-compatible.
        || (seg0, seg1) == (0x0064, 0xff9b)
        || (seg0, seg1) == (0x2001, 0x0000)
        || seg0 == 0x2002
        || segments[..6] == [0; 6]
    {
        AddressClass::Forbidden
    } else if (seg0 & 0xfe00) == 0xfc00 {
        AddressClass::Private
    } else {
        AddressClass::Public
    };
    if (segments[4] & 0xfdff, segments[5]) == (0, 0x5efe) {
        return stricter(class, classify_v4(embedded(segments[6], segments[7])));
    }
    class
}

fn classify_v4(v4: Ipv4Addr) -> AddressClass {
    let [a, b, c, _] = v4.octets();
    if v4.is_loopback() {
        AddressClass::Loopback
    } else if v4.is_unspecified()
        || v4.is_multicast()
        || v4.is_broadcast()
        || a == 0
        || a >= 240
        || (a, b, c) == (192, 0, 2)
        || (a, b, c) == (198, 51, 100)
        || (a, b, c) == (203, 0, 113)
        || (a, b & 0xfe) == (198, 18)
        // Link-local holds the cloud instance-metadata service (169.254.169.254): never a
        // receiver, whatever the deployment allows.
        || v4.is_link_local()
    {
        AddressClass::Forbidden
    } else if v4.is_private() || (a == 100 && (b & 0xc0) == 64) || (a, b, c) == (192, 0, 0) {
        AddressClass::Private
    } else {
        AddressClass::Public
    }
}

impl EndpointPolicy {
    /// Whether a delivery may connect to `ip`.
    pub fn admits(&self, ip: IpAddr) -> Result<()> {
        let refused = |why: &str| Error::InvalidArgument {
            message: format!("receiver address {ip} is {why}"),
            hint: Some("webhook receivers must be public https endpoints unless the deployment allows otherwise".into()),
        };
        match classify(ip) {
            AddressClass::Public => Ok(()),
            AddressClass::Loopback if self.allow_loopback => Ok(()),
            AddressClass::Loopback => Err(refused("loopback")),
            AddressClass::Private if self.allow_private => Ok(()),
            AddressClass::Private => Err(refused("private")),
            AddressClass::Forbidden => Err(refused("link-local, reserved or not unicast: never a receiver")),
        }
    }

    /// Checks a receiver URL's text: scheme, credentials, host. A host name is checked again,
    /// address by address, when a delivery resolves it.
    pub fn check_url(&self, text: &str) -> Result<url::Url> {
        let invalid = |message: String| Error::InvalidArgument {
            message,
            hint: Some("give an https:// URL of a public receiver, such as https://hooks.example.com/compute".into()),
        };
        if text.len() > URL_BYTES_MAX {
            return Err(invalid(format!("the URL is longer than {URL_BYTES_MAX} bytes")));
        }
        let url = url::Url::parse(text).map_err(|e| invalid(format!("malformed URL: {e}")))?;
        if !url.username().is_empty() || url.password().is_some() {
            return Err(invalid("the URL must not carry credentials".into()));
        }
        if url.fragment().is_some() {
            return Err(invalid("the URL must not have a #fragment".into()));
        }
        let loopback_host = match url.host() {
            None => return Err(invalid("the URL has no host".into())),
            Some(url::Host::Ipv4(v4)) => {
                self.admits(IpAddr::V4(v4))?;
                v4.is_loopback()
            }
            Some(url::Host::Ipv6(v6)) => {
                self.admits(IpAddr::V6(v6))?;
                v6.is_loopback()
            }
            Some(url::Host::Domain(name)) => {
                let name = name.trim_end_matches('.').to_ascii_lowercase();
                let loopback = name == "localhost" || name.ends_with(".localhost");
                if loopback && !self.allow_loopback {
                    return Err(invalid(format!("{name} is loopback")));
                }
                if !loopback && !name.contains('.') {
                    return Err(invalid(format!("{name:?} is not a fully qualified host name")));
                }
                loopback
            }
        };
        match url.scheme() {
            "https" => Ok(url),
            "http" if loopback_host && self.allow_loopback => Ok(url),
            "http" => Err(invalid("receivers must use https:// (http:// only to loopback in dev)".into())),
            other => Err(invalid(format!("scheme {other:?} is not https"))),
        }
    }
}

/// The loopback addresses `localhost` stands for.
pub const LOCALHOST: [IpAddr; 2] = [IpAddr::V4(Ipv4Addr::LOCALHOST), IpAddr::V6(Ipv6Addr::LOCALHOST)];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn standard_webhooks_known_answer() {
        // The specification's example secret, message and signature.
        let secret = Secret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let body = br#"{"test": 2432232314}"#;
        let sig = secret.sign("msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body);
        assert_eq!(sig, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
        let header = format!("v1,bm9wZQ== {sig}");
        assert!(verify(&secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body, &header, 1614265330 + 10));
        assert!(!verify(&secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, b"{}", &header, 1614265330));
        assert!(!verify(&secret, "msg_other", 1614265330, body, &header, 1614265330));
        assert!(!verify(&secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body, &header, 1614265330 + 301));
        assert_eq!(Secret::parse(&secret.expose()).unwrap().0, secret.0);
        assert!(Secret::parse("whsec_").is_err() && Secret::parse("nope").is_err());
    }

    #[test]
    fn url_policy() {
        let public = EndpointPolicy::default();
        let dev = EndpointPolicy { allow_loopback: true, allow_private: false };
        let lan = EndpointPolicy { allow_loopback: false, allow_private: true };
        assert!(public.check_url("https://hooks.example.com/compute").is_ok());
        for bad in [
            "http://hooks.example.com/x",
            "ftp://hooks.example.com/x",
            "https://user:pw@hooks.example.com/",
            "https://127.0.0.1/",
            "https://localhost/",
            "https://10.1.2.3/",
            "https://192.168.0.1/",
            "https://169.254.169.254/latest/meta-data",
            "https://[fe80::1]/",
            "https://[fd00::1]/",
            "https://[::ffff:10.0.0.1]/",
            "https://0.0.0.0/",
            "https://224.0.0.1/",
            "https://100.64.0.1/",
            "https://intranet/",
            "not a url",
        ] {
            assert!(public.check_url(bad).is_err(), "{bad} should be refused");
        }
        assert!(dev.check_url("http://127.0.0.1:8080/hook").is_ok());
        assert!(dev.check_url("http://localhost:8080/hook").is_ok());
        assert!(dev.check_url("http://10.0.0.1/hook").is_err());
        assert!(lan.check_url("https://10.0.0.1/hook").is_ok());
        assert!(lan.check_url("http://10.0.0.1/hook").is_err());
        assert!(lan.check_url("https://127.0.0.1/hook").is_err());
        for never in [
            "https://169.254.169.254/",
            "https://[fe80::1]/",
            "https://[fd00:ec2::254]/",
            "https://[2001:0:1::1]/",
            "https://[fec0::1]/",
        ] {
            assert!(lan.check_url(never).is_err() && dev.check_url(never).is_err(), "{never} is never a receiver");
        }
    }

    /// Regression: `::ffff:0:0:0/96` (IPv4-translated) counted as public whatever
    /// IPv4 address it carried. Every IPv4-embedding IPv6 form, carrying a loopback, private,
    /// link-local (metadata) or public IPv4 address, is refused by every policy unless the IPv4
    /// address itself would be admitted.
    #[test]
    fn ipv4_embedding_ipv6_forms_are_checked_against_the_ipv4_rules() {
        let policies = [
            EndpointPolicy { allow_loopback: false, allow_private: false },
            EndpointPolicy { allow_loopback: true, allow_private: false },
            EndpointPolicy { allow_loopback: false, allow_private: true },
            EndpointPolicy { allow_loopback: true, allow_private: true },
        ];
        let carried: [Ipv4Addr; 5] = [
            Ipv4Addr::new(127, 0, 0, 1),
            Ipv4Addr::new(10, 1, 2, 3),
            Ipv4Addr::new(169, 254, 169, 254),
            Ipv4Addr::new(100, 64, 0, 1),
            Ipv4Addr::new(8, 8, 8, 8),
        ];
        // Each form as a function of the IPv4 address it carries, and whether it reaches that
        // address itself (true) or only through a translator or tunnel (false: never admitted).
        type Form = (&'static str, fn(u16, u16) -> Ipv6Addr, bool);
        let forms: [Form; 10] = [
            ("IPv4-mapped ::ffff:0:0/96", |hi, lo| Ipv6Addr::new(0, 0, 0, 0, 0, 0xffff, hi, lo), true),
            ("IPv4-translated ::ffff:0:0:0/96", |hi, lo| Ipv6Addr::new(0, 0, 0, 0, 0xffff, 0, hi, lo), true),
            ("IPv4-compatible ::/96", |hi, lo| Ipv6Addr::new(0, 0, 0, 0, 0, 0, hi, lo), false),
            ("NAT64 64:ff9b::/96", |hi, lo| Ipv6Addr::new(0x64, 0xff9b, 0, 0, 0, 0, hi, lo), false),
            ("local NAT64 64:ff9b:1::/48 (as /96)", |hi, lo| Ipv6Addr::new(0x64, 0xff9b, 1, 0, 0, 0, hi, lo), false),
            ("local NAT64 64:ff9b:1::/48 (as /48)", |hi, lo| Ipv6Addr::new(0x64, 0xff9b, 1, hi, lo >> 8, lo << 8, 0, 0), false),
            ("6to4 2002::/16", |hi, lo| Ipv6Addr::new(0x2002, hi, lo, 0, 0, 0, 0, 1), false),
            ("Teredo 2001::/32", |hi, lo| Ipv6Addr::new(0x2001, 0, 0x4136, 0xe378, 0x8000, 0x63bf, !hi, !lo), false),
            ("ISATAP ::0:5efe:a.b.c.d", |hi, lo| Ipv6Addr::new(0x2a00, 0x1450, 0, 0, 0, 0x5efe, hi, lo), true),
            ("ISATAP ::200:5efe:a.b.c.d", |hi, lo| Ipv6Addr::new(0x2a00, 0x1450, 0, 0, 0x200, 0x5efe, hi, lo), true),
        ];
        for (name, form, direct) in forms {
            for v4 in carried {
                let [a, b, c, d] = v4.octets();
                let v6 = form(u16::from_be_bytes([a, b]), u16::from_be_bytes([c, d]));
                for policy in policies {
                    let v4_admitted = policy.admits(IpAddr::V4(v4)).is_ok();
                    let v6_admitted = policy.admits(IpAddr::V6(v6)).is_ok();
                    assert_eq!(v6_admitted, direct && v4_admitted, "{name}: {v6} carrying {v4} under {policy:?}");
                }
            }
        }
        // As URLs too, where the saved text is checked.
        let lan = EndpointPolicy { allow_loopback: false, allow_private: true };
        for bad in ["https://[::ffff:0:7f00:1]/", "https://[::ffff:0:a9fe:a9fe]/", "https://[64:ff9b:1::a00:1]/"] {
            assert!(lan.check_url(bad).is_err(), "{bad} should be refused");
        }
        assert!(EndpointPolicy::default().check_url("https://[::ffff:0:a00:1]/").is_err());
        assert!(EndpointPolicy::default().check_url("https://[::ffff:0:808:808]/").is_ok());
    }
}
