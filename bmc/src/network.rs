//! Which addresses a BMC may be reached at: the operator's allowlist of BMC networks
//! ([`BmcNetworks`], `--bmc-allow-network CIDR`), checked on every address a BMC's name
//! resolves to, when the client connects, and on an address literal at enrollment.
//!
//! A tenant names its BMC's address; without this check the control plane would connect
//! wherever it is told, with its own network position (its loopback, the networks it sits on,
//! the cloud's metadata service), and carry what it finds back in errors. So:
//! - never: unspecified, multicast, broadcast, `0/8`, reserved (`240/4`);
//! - an address inside a network the operator named is admitted, except this host's own
//!   addresses (its loopback among them), which only a single-address entry names
//!   (`127.0.0.1/32`: the tests' and a one-box lab's emulator): a `10.0.0.0/8` that holds the
//!   control plane's own address does not open it to BMC requests;
//! - any other address only when it is public: not loopback, private (RFC 1918, CGNAT,
//!   unique-local), link-local (and with it the metadata service), documentation, benchmarking,
//!   translated or tunnelled IPv4 (NAT64, 6to4, Teredo), and not this host's own.
//!
//! With no `--bmc-allow-network`, only public addresses are admitted: a fleet's BMCs are on a
//! management network, which its operator names.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::{BmcError, BmcResult};

/// The most networks an operator names (each address is checked against each).
pub const NETWORKS_MAX: usize = 256;

/// One network, `address/prefix`, its address masked to the prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Network {
    address: IpAddr,
    prefix_bits: u8,
}

impl Network {
    /// `10.20.0.0/16`, `fd00:bmc::/64`, or a single address (`/32` or `/128` implied).
    pub fn parse(text: &str) -> Result<Network, String> {
        let (address, prefix) = match text.split_once('/') {
            Some((address, prefix)) => (address, Some(prefix)),
            None => (text, None),
        };
        let address: IpAddr =
            address.trim().parse().map_err(|_| format!("{text:?} is not a network (ADDRESS/PREFIX, such as 10.20.0.0/16)"))?;
        let address = canonical(address);
        let width = if address.is_ipv4() { 32 } else { 128 };
        let prefix_bits = match prefix {
            None => width,
            Some(p) => match p.trim().parse::<u8>() {
                Ok(bits) if bits <= width => bits,
                _ => return Err(format!("{text:?}: the prefix is 0 to {width} bits")),
            },
        };
        Ok(Network { address: mask(address, prefix_bits), prefix_bits })
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        ip.is_ipv4() == self.address.is_ipv4() && mask(ip, self.prefix_bits) == self.address
    }

    /// Whether it names exactly one address.
    fn is_single_address(&self) -> bool {
        self.prefix_bits == if self.address.is_ipv4() { 32 } else { 128 }
    }
}

impl std::fmt::Display for Network {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.address, self.prefix_bits)
    }
}

fn mask(ip: IpAddr, bits: u8) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => {
            let keep = if bits == 0 { 0 } else { u32::MAX << (32 - u32::from(bits)) };
            IpAddr::V4(Ipv4Addr::from(u32::from(v4) & keep))
        }
        IpAddr::V6(v6) => {
            let keep = if bits == 0 { 0 } else { u128::MAX << (128 - u32::from(bits)) };
            IpAddr::V6(Ipv6Addr::from(u128::from(v6) & keep))
        }
    }
}

/// An IPv4-mapped IPv6 address is the IPv4 address it reaches.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// Whether an address is this host's own: loopback, or one a socket can be bound to (the
/// kernel's own list of its interfaces' addresses).
pub fn is_own_address(ip: IpAddr) -> bool {
    let ip = canonical(ip);
    ip.is_loopback() || std::net::UdpSocket::bind((ip, 0)).is_ok()
}

/// The operator's BMC networks. The default names none: public addresses only.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BmcNetworks {
    allowed: Vec<Network>,
}

/// Why an address was refused (for the operator's log; the tenant's error does not say).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    NotUnicast,
    ThisHost,
    NotPublicNorNamed,
}

impl BmcNetworks {
    /// `--bmc-allow-network`'s values, each `ADDRESS/PREFIX` or one address.
    pub fn parse<S: AsRef<str>>(texts: &[S]) -> Result<BmcNetworks, String> {
        if texts.len() > NETWORKS_MAX {
            return Err(format!("at most {NETWORKS_MAX} BMC networks"));
        }
        let allowed = texts.iter().map(|t| Network::parse(t.as_ref())).collect::<Result<_, _>>()?;
        Ok(BmcNetworks { allowed })
    }

    pub fn networks(&self) -> &[Network] {
        &self.allowed
    }

    /// Whether a BMC request may connect to `ip`, `own` saying whether it is this host's.
    pub fn admits_with(&self, ip: IpAddr, own: impl Fn(IpAddr) -> bool) -> Result<(), Refusal> {
        let ip = canonical(ip);
        if !is_unicast(ip) {
            return Err(Refusal::NotUnicast);
        }
        let named: Vec<&Network> = self.allowed.iter().filter(|n| n.contains(ip)).collect();
        let is_own = own(ip);
        if is_own {
            return if named.iter().any(|n| n.is_single_address()) { Ok(()) } else { Err(Refusal::ThisHost) };
        }
        if !named.is_empty() || is_public(ip) { Ok(()) } else { Err(Refusal::NotPublicNorNamed) }
    }

    /// [`BmcNetworks::admits_with`] this host's addresses.
    pub fn admits(&self, ip: IpAddr) -> Result<(), Refusal> {
        self.admits_with(ip, is_own_address)
    }

    /// The check of an address literal (a name passes: it is checked when a request resolves
    /// it, address by address).
    pub fn check_literal(&self, host: &url::Host<&str>) -> BmcResult<()> {
        match host {
            url::Host::Domain(_) => Ok(()),
            literal => self.check_host(literal),
        }
    }

    /// The check of an address as a tenant enrolls it: an IP literal is checked now;
    /// `localhost` (and `*.localhost`) as loopback; any other name when the client resolves it.
    pub fn check_host(&self, host: &url::Host<&str>) -> BmcResult<()> {
        let ip = match host {
            url::Host::Ipv4(v4) => IpAddr::V4(*v4),
            url::Host::Ipv6(v6) => IpAddr::V6(*v6),
            url::Host::Domain(name) => {
                let name = name.trim_end_matches('.').to_ascii_lowercase();
                if name == "localhost" || name.ends_with(".localhost") {
                    IpAddr::V4(Ipv4Addr::LOCALHOST)
                } else {
                    return Ok(());
                }
            }
        };
        self.admits(ip).map_err(|refusal| {
            tracing::warn!(address = %ip, ?refusal, "a BMC address outside the BMC networks was refused");
            address_refused()
        })
    }
}

/// The error of a refused address: the same whatever the reason, and without the address a
/// name resolved to (the tenant learns that it was refused, not what is inside).
pub fn address_refused() -> BmcError {
    BmcError::AddressRefused(
        "the BMC's address is not on a network this deployment reaches BMCs on; hint: the operator names the BMC networks with --bmc-allow-network CIDR (loopback, link-local and the control plane's own addresses are never taken unless named exactly)".into(),
    )
}

fn is_unicast(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, ..] = v4.octets();
            !(v4.is_unspecified() || v4.is_multicast() || v4.is_broadcast() || a == 0 || a >= 240)
        }
        IpAddr::V6(v6) => !(v6.is_unspecified() || v6.is_multicast()),
    }
}

fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, c, _] = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || (a == 100 && (b & 0xc0) == 64)
                || (a, b, c) == (192, 0, 0)
                || (a, b, c) == (192, 0, 2)
                || (a, b, c) == (198, 51, 100)
                || (a, b, c) == (203, 0, 113)
                || (a, b & 0xfe) == (198, 18))
        }
        IpAddr::V6(v6) => {
            let segments = v6.segments();
            let [seg0, seg1, ..] = segments;
            !(v6.is_loopback()
                || (seg0 & 0xfe00) == 0xfc00
                || (seg0 & 0xffc0) == 0xfe80
                || (seg0 & 0xffc0) == 0xfec0
                || (seg0, seg1) == (0x2001, 0x0db8)
                || (seg0, seg1) == (0x0064, 0xff9b)
                || (seg0, seg1) == (0x2001, 0x0000)
                || seg0 == 0x2002
                || segments[..6] == [0; 6])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    /// This host, as the tests see it: loopback and 10.0.0.2.
    fn own(ip: IpAddr) -> bool {
        ip.is_loopback() || ip == IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2))
    }

    #[test]
    fn by_default_only_public_addresses_are_admitted() {
        let none = BmcNetworks::default();
        for public in ["8.8.8.8", "2606:4700::1111"] {
            assert_eq!(none.admits_with(ip(public), own), Ok(()), "{public}");
        }
        for (refused, why) in [
            ("127.0.0.1", Refusal::ThisHost),
            ("127.8.9.10", Refusal::ThisHost),
            ("::1", Refusal::ThisHost),
            ("::ffff:127.0.0.1", Refusal::ThisHost),
            ("10.0.0.2", Refusal::ThisHost),
            ("10.1.2.3", Refusal::NotPublicNorNamed),
            ("192.168.1.1", Refusal::NotPublicNorNamed),
            ("169.254.169.254", Refusal::NotPublicNorNamed),
            ("fe80::1", Refusal::NotPublicNorNamed),
            ("fd00::5", Refusal::NotPublicNorNamed),
            ("100.64.0.1", Refusal::NotPublicNorNamed),
            ("64:ff9b::7f00:1", Refusal::NotPublicNorNamed),
            ("0.0.0.0", Refusal::NotUnicast),
            ("224.0.0.1", Refusal::NotUnicast),
            ("255.255.255.255", Refusal::NotUnicast),
        ] {
            assert_eq!(none.admits_with(ip(refused), own), Err(why), "{refused}");
        }
    }

    #[test]
    fn named_networks_admit_their_addresses_but_not_this_hosts_unless_named_exactly() {
        let networks = BmcNetworks::parse(&["10.0.0.0/8", "fd00:b::/64", "127.0.0.1/32"]).unwrap();
        assert_eq!(networks.admits_with(ip("10.1.2.3"), own), Ok(()));
        assert_eq!(networks.admits_with(ip("fd00:b::9"), own), Ok(()));
        assert_eq!(networks.admits_with(ip("127.0.0.1"), own), Ok(()), "named exactly");
        assert_eq!(networks.admits_with(ip("::ffff:127.0.0.1"), own), Ok(()), "the same address, mapped");
        assert_eq!(networks.admits_with(ip("127.0.0.2"), own), Err(Refusal::ThisHost), "only the address named");
        assert_eq!(networks.admits_with(ip("10.0.0.2"), own), Err(Refusal::ThisHost), "this host, inside 10/8");
        assert_eq!(networks.admits_with(ip("192.168.1.1"), own), Err(Refusal::NotPublicNorNamed));
        assert_eq!(networks.admits_with(ip("169.254.169.254"), own), Err(Refusal::NotPublicNorNamed));
        let loopback = BmcNetworks::parse(&["127.0.0.0/8"]).unwrap();
        assert_eq!(loopback.admits_with(ip("127.0.0.1"), own), Err(Refusal::ThisHost), "a loopback range is not an address");
    }

    #[test]
    fn networks_parse_and_mask() {
        assert_eq!(Network::parse("10.20.30.40/16").unwrap().to_string(), "10.20.0.0/16");
        assert_eq!(Network::parse("10.0.0.7").unwrap().to_string(), "10.0.0.7/32");
        assert_eq!(Network::parse("fd00::1/8").unwrap().to_string(), "fd00::/8");
        assert!(Network::parse("10.0.0.0/33").is_err());
        assert!(Network::parse("bmc.example/24").is_err());
        assert!(BmcNetworks::parse(&vec!["10.0.0.0/8"; NETWORKS_MAX + 1]).is_err());
    }

    #[test]
    fn a_literal_or_localhost_is_checked_at_enrollment_and_other_names_at_connect() {
        let none = BmcNetworks::default();
        for refused in ["https://127.0.0.1:8443", "https://localhost", "https://bmc.localhost.", "https://[::1]"] {
            let url = url::Url::parse(refused).unwrap();
            assert!(matches!(none.check_host(&url.host().unwrap()), Err(BmcError::AddressRefused(_))), "{refused}");
        }
        let url = url::Url::parse("https://bmc-1.mgmt.example").unwrap();
        assert!(none.check_host(&url.host().unwrap()).is_ok());
        let tests = BmcNetworks::parse(&["127.0.0.1/32"]).unwrap();
        let url = url::Url::parse("https://127.0.0.1:8443").unwrap();
        assert!(tests.check_host(&url.host().unwrap()).is_ok());
    }
}
