//! fulcrum's own identity on one vserver and the transport it speaks there: what it writes
//! into its Via, Record-Route and Path, and which addresses mean "us". PURE.

use super::rewrite::SEED;
use super::scan::parse_ip;
use std::net::{IpAddr, SocketAddr};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The start of fulcrum's Record-Route line; [`Local::route_uri_open`] is what follows it.
const RR_PREFIX: &str = "Record-Route: ";

/// Transport fulcrum writes into its Via and Record-Route.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transport {
    Udp,
    Tcp,
    Tls,
    /// WebSocket (RFC 7118): `SIP/2.0/WS`, `;transport=ws`.
    Ws,
    /// Secure WebSocket: `SIP/2.0/WSS`, `;transport=wss`.
    Wss,
}

impl Transport {
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Udp => "UDP",
            Transport::Tcp => "TCP",
            Transport::Tls => "TLS",
            Transport::Ws => "WS",
            Transport::Wss => "WSS",
        }
    }

    /// Port implied when a Via or URI has none (RFC 3261 §18.1.1, §19.1.2).
    pub fn default_port(self) -> u16 {
        match self {
            Transport::Tls => 5061,
            Transport::Ws => 80,
            Transport::Wss => 443,
            _ => 5060,
        }
    }
}

/// fulcrum's own identity on one vserver: the advertised host:port written into Via and
/// Record-Route, plus any other addresses that also mean "us" (the bound sockets).
///
/// Built once per vserver (the allocation happens at configuration time, not per message).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Local {
    /// Host without brackets, lowercase.
    pub(super) host: String,
    pub(super) ip: Option<IpAddr>,
    pub(super) port: u16,
    pub(super) transport: Transport,
    pub(super) aliases: Vec<SocketAddr>,
    /// The vserver also speaks another transport toward some services (the transports
    /// bridge): fulcrum double record-routes those dialogs (RFC 5658 §3.2), so the first two
    /// Route values may both name it.
    pub(super) bridged: bool,
    /// `Via: SIP/2.0/UDP host:port;branch=` ready to copy.
    pub(super) via_prefix: Vec<u8>,
    /// `Record-Route: <sip:host:port;lr` ready to copy; `>\r\n` or `;fc-svc=..>\r\n` follows.
    pub(super) rr_line: Vec<u8>,
    /// Our address hashed once: the seed of the branch hash.
    pub(super) branch_seed: u64,
}

impl Local {
    /// `host` is a name, an IPv4 address, or an IPv6 address with or without brackets.
    pub fn new(host: &str, port: u16, transport: Transport) -> Local {
        let bare = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host)
            .to_ascii_lowercase();
        let ip = parse_ip(bare.as_bytes()).map(|ip| ip.to_canonical());
        let printable = match ip {
            Some(IpAddr::V6(v6)) => format!("[{v6}]"),
            Some(IpAddr::V4(v4)) => v4.to_string(),
            None => bare.clone(),
        };
        let via_prefix = format!(
            "Via: SIP/2.0/{} {printable}:{port};branch=",
            transport.as_str()
        )
        .into_bytes();
        let rr_param = match transport {
            Transport::Udp => "",
            Transport::Tcp => ";transport=tcp",
            Transport::Tls => ";transport=tls",
            Transport::Ws => ";transport=ws",
            Transport::Wss => ";transport=wss",
        };
        let rr_line = format!("{RR_PREFIX}<sip:{printable}:{port}{rr_param};lr").into_bytes();
        let branch_seed = xxh3_64_with_seed(bare.as_bytes(), SEED ^ u64::from(port));
        Local {
            branch_seed,
            host: bare,
            ip,
            port,
            transport,
            aliases: Vec::new(),
            bridged: false,
            via_prefix,
            rr_line,
        }
    }

    /// Parse an `advertise` value: `host`, `host:port`, `[v6]` or `[v6]:port` (a bare IPv6
    /// address without brackets takes `default_port`). `None` when it is not one of those.
    pub fn parse(advertise: &str, default_port: u16, transport: Transport) -> Option<Local> {
        let (host, port) = if let Some(rest) = advertise.strip_prefix('[') {
            let close = rest.find(']')?;
            let port = match &rest[close + 1..] {
                "" => default_port,
                p => p.strip_prefix(':')?.parse().ok()?,
            };
            (&rest[..close], port)
        } else if advertise.matches(':').count() > 1 {
            (advertise, default_port)
        } else {
            match advertise.split_once(':') {
                Some((h, p)) => (h, p.parse().ok()?),
                None => (advertise, default_port),
            }
        };
        let valid = !host.is_empty()
            && (parse_ip(host.as_bytes()).is_some()
                || host
                    .bytes()
                    .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'.'));
        valid.then(|| Local::new(host, port, transport))
    }

    /// The advertised address of a socket address (for vservers without `advertise`).
    pub fn from_addr(addr: SocketAddr, transport: Transport) -> Local {
        Local::new(
            &addr.ip().to_canonical().to_string(),
            addr.port(),
            transport,
        )
    }

    /// This identity as it faces services from another address (`service_source`): its Via
    /// names `from`, so that services answer there, and everything else (Record-Route, the
    /// branch, what counts as fulcrum) stays this identity's. `from` becomes an alias.
    pub fn sending_from(&self, from: SocketAddr) -> Local {
        let sent_by = Local::from_addr(from, self.transport);
        let mut l = self.clone().with_alias(from);
        l.via_prefix = sent_by.via_prefix;
        l
    }

    /// This identity with `addr` also meaning fulcrum (kept once).
    pub fn with_alias(mut self, addr: SocketAddr) -> Local {
        if !self.is_local_addr(addr) {
            self.aliases.push(addr);
        }
        self
    }

    /// Other addresses that are also fulcrum (the bound sockets, other listeners).
    pub fn with_aliases(mut self, aliases: &[SocketAddr]) -> Local {
        self.aliases = aliases.to_vec();
        self
    }

    /// The same host, port and aliases on another transport (a leg of the transports bridge
    /// that shares the vserver's address, e.g. TCP toward sip-tcp services of a sip-tls
    /// vserver).
    pub fn with_transport(&self, transport: Transport) -> Local {
        Local::new(&self.host, self.port, transport).with_aliases(&self.aliases)
    }

    /// This identity as one leg of a bridge whose other legs are `others`: their addresses
    /// become aliases (a Via or Route naming any leg is fulcrum's), and the first two Route
    /// values may name fulcrum (RFC 5658 double record-routing).
    pub fn bridged_with(mut self, others: &[Local]) -> Local {
        for o in others {
            for a in o.addrs() {
                if !self.is_local_addr(a) {
                    self.aliases.push(a);
                }
            }
        }
        self.bridged = true;
        self
    }

    /// This identity giving the branches `other` gives: the legs of a transports bridge, so
    /// that a held request's attempts may leave on any leg and their answers still find its
    /// transaction by branch. A branch still differs per hop: it hashes the top Via received.
    pub fn branching_as(mut self, other: &Local) -> Local {
        self.branch_seed = other.branch_seed;
        self
    }

    /// The addresses that are this identity: the advertised one when it is an IP address,
    /// and the aliases.
    pub fn addrs(&self) -> impl Iterator<Item = SocketAddr> + '_ {
        self.ip
            .map(|ip| SocketAddr::new(ip, self.port))
            .into_iter()
            .chain(self.aliases.iter().copied())
    }

    /// Whether this identity is a leg of a transports bridge ([`Local::bridged_with`]).
    pub fn is_bridged(&self) -> bool {
        self.bridged
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn transport(&self) -> Transport {
        self.transport
    }

    /// `true` when `host`/`port` (as written in a Via or URI; port defaulted by the transport)
    /// name fulcrum. Names compare case-insensitively, addresses by value.
    pub fn is_local(&self, host: &[u8], port: Option<u16>) -> bool {
        let port = port.unwrap_or(self.transport.default_port());
        // Fast path: our own Via / Record-Route echoed back, byte for byte (every response).
        if port == self.port && host.eq_ignore_ascii_case(self.host.as_bytes()) {
            return true;
        }
        let ip = parse_ip(host).map(|ip| ip.to_canonical());
        if port == self.port {
            let same = match (ip, self.ip) {
                (Some(a), Some(b)) => a == b,
                (None, None) => host.eq_ignore_ascii_case(self.host.as_bytes()),
                _ => false,
            };
            if same {
                return true;
            }
        }
        ip.is_some_and(|ip| self.is_local_addr(SocketAddr::new(ip, port)))
    }

    /// `true` when `addr` is the advertised address or an alias.
    /// The opening of fulcrum's route URI, `<sip:host:port;transport=..;lr`, as its
    /// Record-Route and Path write it before their parameters and `>`.
    pub(super) fn route_uri_open(&self) -> &[u8] {
        &self.rr_line[RR_PREFIX.len()..]
    }

    pub fn is_local_addr(&self, addr: SocketAddr) -> bool {
        let addr = SocketAddr::new(addr.ip().to_canonical(), addr.port());
        (Some(addr.ip()) == self.ip && addr.port() == self.port)
            || self
                .aliases
                .iter()
                .any(|a| a.port() == addr.port() && a.ip().to_canonical() == addr.ip())
    }
}
