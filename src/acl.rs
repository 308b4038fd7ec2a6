//! Access lists of a vserver: `allow` and `deny` CIDR lists over client addresses. PURE.
//!
//! A source is let in when no `deny` network holds it and, if an `allow` list is given, some
//! `allow` network does (deny wins). IPv4-mapped IPv6 addresses (`::ffff:a.b.c.d`, what a
//! dual-stack socket reports for an IPv4 client) are matched as the IPv4 address they carry.
//! Networks are kept as integers and masks, so a check is a few comparisons per network and
//! never allocates.

use std::net::IpAddr;

/// One network: address and prefix length, host bits zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cidr {
    V4 { net: u32, mask: u32, prefix: u8 },
    V6 { net: u128, mask: u128, prefix: u8 },
}

/// Why a CIDR text was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CidrError {
    #[error("`{0}` is not an IP address or ADDRESS/PREFIX")]
    Syntax(String),
    #[error("prefix length {prefix} is beyond {max} for this address family")]
    Prefix { prefix: u32, max: u32 },
    #[error("`{text}` has host bits set (the network is {network})")]
    HostBits { text: String, network: String },
}

impl Cidr {
    /// Parse `ADDRESS/PREFIX`, or a bare address (a single host). An IPv4-mapped IPv6
    /// network is taken as the IPv4 network it carries.
    pub fn parse(text: &str) -> Result<Cidr, CidrError> {
        let syntax = || CidrError::Syntax(text.to_owned());
        let (addr, prefix) = match text.split_once('/') {
            Some((a, p)) => {
                let p: u32 = p.parse().map_err(|_| syntax())?;
                (a, Some(p))
            }
            None => (text, None),
        };
        let ip: IpAddr = addr.trim().parse().map_err(|_| syntax())?;
        let cidr = match ip {
            IpAddr::V4(v4) => Cidr::v4(u32::from(v4), prefix.unwrap_or(32))?,
            // A network inside the IPv4-mapped range is the IPv4 network it carries.
            IpAddr::V6(v6) => match (v6.to_ipv4_mapped(), prefix.unwrap_or(128)) {
                (Some(v4), p) if p >= 96 => {
                    Cidr::v4(u32::from(v4), p - 96).map_err(|_| CidrError::Prefix {
                        prefix: p,
                        max: 128,
                    })?
                }
                (_, p) => Cidr::v6(u128::from(v6), p)?,
            },
        };
        let (host, net) = match (ip, cidr) {
            (IpAddr::V4(v4), Cidr::V4 { net, .. }) => (u128::from(u32::from(v4)), u128::from(net)),
            (IpAddr::V6(v6), Cidr::V4 { net, .. }) => (
                v6.to_ipv4_mapped().map_or(0, |v| u128::from(u32::from(v))),
                u128::from(net),
            ),
            (IpAddr::V6(v6), Cidr::V6 { net, .. }) => (u128::from(v6), net),
            (IpAddr::V4(_), Cidr::V6 { .. }) => return Err(syntax()),
        };
        if host != net {
            return Err(CidrError::HostBits {
                text: text.to_owned(),
                network: cidr.to_string(),
            });
        }
        Ok(cidr)
    }

    fn v4(addr: u32, prefix: u32) -> Result<Cidr, CidrError> {
        if prefix > 32 {
            return Err(CidrError::Prefix { prefix, max: 32 });
        }
        let mask = u32::MAX.checked_shl(32 - prefix).unwrap_or(0);
        Ok(Cidr::V4 {
            net: addr & mask,
            mask,
            prefix: prefix as u8,
        })
    }

    fn v6(addr: u128, prefix: u32) -> Result<Cidr, CidrError> {
        if prefix > 128 {
            return Err(CidrError::Prefix { prefix, max: 128 });
        }
        let mask = u128::MAX.checked_shl(128 - prefix).unwrap_or(0);
        Ok(Cidr::V6 {
            net: addr & mask,
            mask,
            prefix: prefix as u8,
        })
    }

    /// Whether `ip` is in this network (IPv4-mapped addresses as IPv4).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self, ip.to_canonical()) {
            (Cidr::V4 { net, mask, .. }, IpAddr::V4(v4)) => u32::from(v4) & mask == *net,
            (Cidr::V6 { net, mask, .. }, IpAddr::V6(v6)) => u128::from(v6) & mask == *net,
            _ => false,
        }
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Cidr::V4 { net, prefix, .. } => {
                write!(f, "{}/{prefix}", std::net::Ipv4Addr::from(net))
            }
            Cidr::V6 { net, prefix, .. } => {
                write!(f, "{}/{prefix}", std::net::Ipv6Addr::from(net))
            }
        }
    }
}

/// A vserver's access lists.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Acl {
    /// `None`: everyone (no `allow` list given).
    allow: Option<Vec<Cidr>>,
    deny: Vec<Cidr>,
}

impl Acl {
    pub fn new(allow: Option<Vec<Cidr>>, deny: Vec<Cidr>) -> Acl {
        Acl { allow, deny }
    }

    /// True when the lists let everyone in (nothing to check on the data path).
    pub fn is_open(&self) -> bool {
        self.allow.is_none() && self.deny.is_empty()
    }

    /// Whether a client at `ip` may send to the vserver: in no `deny` network and, with an
    /// `allow` list, in one of its networks.
    pub fn permits(&self, ip: IpAddr) -> bool {
        if self.deny.iter().any(|c| c.contains(ip)) {
            return false;
        }
        self.allow
            .as_ref()
            .is_none_or(|a| a.iter().any(|c| c.contains(ip)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn parses_networks_hosts_and_refuses_host_bits() {
        assert_eq!(
            Cidr::parse("10.0.0.0/8").map(|c| c.to_string()).as_deref(),
            Ok("10.0.0.0/8")
        );
        assert_eq!(
            Cidr::parse("192.0.2.7").map(|c| c.to_string()).as_deref(),
            Ok("192.0.2.7/32")
        );
        assert_eq!(
            Cidr::parse("2001:db8::/32")
                .map(|c| c.to_string())
                .as_deref(),
            Ok("2001:db8::/32")
        );
        assert_eq!(
            Cidr::parse("::ffff:10.0.0.0/104")
                .map(|c| c.to_string())
                .as_deref(),
            Ok("10.0.0.0/8")
        );
        assert_eq!(
            Cidr::parse("0.0.0.0/0").map(|c| c.to_string()).as_deref(),
            Ok("0.0.0.0/0")
        );
        assert_eq!(
            Cidr::parse("10.1.2.3/8"),
            Err(CidrError::HostBits {
                text: "10.1.2.3/8".into(),
                network: "10.0.0.0/8".into()
            })
        );
        assert_eq!(
            Cidr::parse("10.0.0.0/33"),
            Err(CidrError::Prefix {
                prefix: 33,
                max: 32
            })
        );
        assert_eq!(
            Cidr::parse("2001:db8::/129"),
            Err(CidrError::Prefix {
                prefix: 129,
                max: 128
            })
        );
        for bad in [
            "",
            "10.0.0.0/",
            "10.0.0/8",
            "fe80::1%eth0",
            "10.0.0.0/-1",
            "host/8",
        ] {
            assert!(
                matches!(Cidr::parse(bad), Err(CidrError::Syntax(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn deny_wins_and_allow_restricts() {
        let c = |s: &str| Cidr::parse(s).expect("cidr");
        let acl = Acl::new(
            Some(vec![c("10.0.0.0/8"), c("2001:db8::/32")]),
            vec![c("10.6.0.0/16")],
        );
        assert!(acl.permits(ip("10.1.2.3")));
        assert!(acl.permits(ip("::ffff:10.1.2.3")), "IPv4-mapped is IPv4");
        assert!(!acl.permits(ip("10.6.0.1")), "deny wins");
        assert!(!acl.permits(ip("192.0.2.1")), "outside allow");
        assert!(acl.permits(ip("2001:db8::9")));
        assert!(!acl.permits(ip("2001:db9::9")));
        let open = Acl::default();
        assert!(open.is_open() && open.permits(ip("198.51.100.1")));
        let deny_only = Acl::new(None, vec![c("198.51.100.0/24")]);
        assert!(!deny_only.permits(ip("198.51.100.1")));
        assert!(deny_only.permits(ip("198.51.101.1")));
    }

    proptest! {
        /// A network holds exactly the addresses that share its first `prefix` bits.
        #[test]
        fn contains_is_a_prefix_match(a in any::<u32>(), b in any::<u32>(), prefix in 0u32..=32) {
            let mask = u32::MAX.checked_shl(32 - prefix).unwrap_or(0);
            let text = format!("{}/{prefix}", std::net::Ipv4Addr::from(a & mask));
            let c = Cidr::parse(&text).expect("network");
            let inside = b & mask == a & mask;
            prop_assert_eq!(c.contains(IpAddr::V4(b.into())), inside);
            prop_assert_eq!(c.contains(IpAddr::V6(std::net::Ipv4Addr::from(b).to_ipv6_mapped())), inside);
        }

        #[test]
        fn v6_contains_is_a_prefix_match(a in any::<u128>(), b in any::<u128>(), prefix in 0u32..=128) {
            let mask = u128::MAX.checked_shl(128 - prefix).unwrap_or(0);
            let text = format!("{}/{prefix}", std::net::Ipv6Addr::from(a & mask));
            // Mapped networks are IPv4 ones: tested above.
            prop_assume!(std::net::Ipv6Addr::from(a & mask).to_ipv4_mapped().is_none());
            let c = Cidr::parse(&text).expect("network");
            let addr = std::net::Ipv6Addr::from(b);
            prop_assume!(addr.to_ipv4_mapped().is_none());
            prop_assert_eq!(c.contains(IpAddr::V6(addr)), b & mask == a & mask);
        }
    }
}
