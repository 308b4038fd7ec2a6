//! The validated configuration model (docs/config.md; fields in README.md, "Configuration reference"). PURE.
//!
//! These types are what the rest of fulcrum consumes; they are produced only by
//! [`crate::config::parse`], which checks every field, so a value of these types is
//! always internally consistent (names resolve, ranges hold, methods fit protocols).

use super::yaml::Pos;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

/// The whole file.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub lb: LbParams,
    pub admin: Admin,
    pub logging: Logging,
    pub monitors: Vec<Monitor>,
    pub services: Vec<Service>,
    pub vservers: Vec<Vserver>,
    /// `flow_key_file`: the keys of flow tokens (docs/sip.md, "Path and flow tokens"), read
    /// by [`crate::config::load`]; `None`: each process makes its own.
    pub flow_key_file: Option<FlowKeyFile>,
    /// `dns`: how services named in DNS are looked up (docs/discovery.md).
    pub dns: DnsSettings,
    /// `capture.hep`: every SIP message sent to a HEP collector (docs/capture.md); `None`: off.
    pub capture: Option<HepCapture>,
    /// What is valid but probably not meant, with its position and field path
    /// (`fulcrum check` prints them, `fulcrum run` logs them); never a reason to refuse.
    pub warnings: Vec<super::Problem>,
}

/// How capture packets reach the collector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaptureTransport {
    Udp,
    Tcp,
}

impl CaptureTransport {
    pub const ALL: [(&'static str, CaptureTransport); 2] = [
        ("udp", CaptureTransport::Udp),
        ("tcp", CaptureTransport::Tcp),
    ];
}

/// The global `capture.hep` block: where SIP messages are sent as HEP3 packets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HepCapture {
    pub address: SocketAddr,
    pub transport: CaptureTransport,
    /// The capture agent id written in every packet (Homer shows it as the node).
    pub id: u32,
    /// The authentication key chunk, when the collector wants one.
    pub password: Option<String>,
    /// Only these vservers' messages; `None`: every SIP vserver's.
    pub vservers: Option<Vec<String>>,
    /// The health monitors' SIP OPTIONS too.
    pub probes: bool,
    /// Over UDP: packets sent in UDP GSO groups (`UDP_SEGMENT`), each padded to its group's
    /// size by a chunk collectors skip.
    pub udp_gso: bool,
}

/// The global `dns` block: the servers asked and the bounds on how often a name is asked
/// again (its records' TTL, clamped to `min_refresh..=max_refresh`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsSettings {
    /// Empty: the system's resolver configuration (`resolv_conf`).
    pub servers: Vec<SocketAddr>,
    pub min_refresh: Duration,
    pub max_refresh: Duration,
    /// The system's resolver configuration, read when `servers` is empty, and again
    /// whenever it changes (a DHCP lease, systemd-resolved, a container's runtime rewrites it).
    pub resolv_conf: std::path::PathBuf,
}

impl Default for DnsSettings {
    fn default() -> Self {
        DnsSettings {
            servers: Vec::new(),
            min_refresh: Duration::from_secs(1),
            max_refresh: Duration::from_secs(300),
            resolv_conf: std::path::PathBuf::from("/etc/resolv.conf"),
        }
    }
}

/// A service's `dns`: the name its members are published under.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DnsName {
    /// Fully qualified, lowercase, with the final dot (`sip.example.org.`).
    pub name: String,
    /// What is asked for the name.
    pub kind: DnsKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DnsKind {
    /// A and AAAA records; every address at the service's `port`.
    Host { port: u16 },
    /// SRV records (a name whose first label starts with `_`, RFC 2782): targets with their
    /// own ports, priorities and weights, the targets' A and AAAA records their addresses.
    Srv,
}

/// `flow_key_file`: one key per line (32 hex digits), the first signing, the others still
/// accepted (a rotation's previous keys).
#[derive(Debug, Clone, PartialEq)]
pub struct FlowKeyFile {
    pub file: ConfigFile,
    /// As read by [`crate::config::load`]; empty until then.
    pub keys: Vec<crate::sip::flow::FlowKey>,
}

/// `path` of a SIP vserver: when a forwarded REGISTER gets fulcrum's Path (RFC 3327).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PathMode {
    /// When the REGISTER says `Supported: path` (RFC 3327 §5.2).
    #[default]
    Auto,
    /// Always: for registrars known to support Path, behind phones that never say so.
    Always,
    /// Never; no flow token in Record-Route either.
    Off,
}

impl PathMode {
    pub const ALL: [(&'static str, PathMode); 3] = [
        ("auto", PathMode::Auto),
        ("always", PathMode::Always),
        ("off", PathMode::Off),
    ];
}

/// Global load-balancing parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LbParams {
    pub hash_algorithm: HashAlgorithm,
    /// 1..=1024, default 256 (prac and jarh table resolution).
    pub hash_fingers: u32,
    /// prac's balance bound (default 1.005).
    pub prac_max_share: PracMaxShare,
}

impl Default for LbParams {
    fn default() -> Self {
        LbParams {
            hash_algorithm: HashAlgorithm::Carp,
            hash_fingers: 256,
            prac_max_share: PracMaxShare::DEFAULT,
        }
    }
}

/// The largest share of the hash space one service may own in a prac table, as a multiple of
/// its weighted share, kept in ten-thousandths (10_050 is 1.005). A looser bound leaves the
/// table room to keep more slots where they are when a service is added (docs/hashing.md,
/// "Balance against disruption").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PracMaxShare(u32);

impl PracMaxShare {
    /// The tightest bound offered, and the default.
    pub const DEFAULT: PracMaxShare = PracMaxShare(10_050);
    /// The loosest bound offered.
    pub const MAX: PracMaxShare = PracMaxShare(15_000);

    /// The bound for a ratio such as 1.05, rounded to ten-thousandths; `None` outside
    /// `DEFAULT..=MAX`.
    pub fn from_ratio(ratio: f64) -> Option<PracMaxShare> {
        let e4 = (ratio * 10_000.0).round();
        (e4.is_finite() && (f64::from(Self::DEFAULT.0)..=f64::from(Self::MAX.0)).contains(&e4))
            .then_some(PracMaxShare(e4 as u32))
    }

    /// The bound as a ratio (1.005 for the default).
    pub fn ratio(self) -> f64 {
        f64::from(self.0) / 10_000.0
    }

    /// How much looser than the default the bound is (0.0 for the default).
    pub fn slack(self) -> f64 {
        f64::from(self.0.saturating_sub(Self::DEFAULT.0)) / 10_000.0
    }
}

/// Consistent-hash algorithm (docs/hashing.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HashAlgorithm {
    Carp,
    Prac,
    Jarh,
}

impl HashAlgorithm {
    pub const ALL: [(&'static str, HashAlgorithm); 3] = [
        ("carp", HashAlgorithm::Carp),
        ("prac", HashAlgorithm::Prac),
        ("jarh", HashAlgorithm::Jarh),
    ];

    pub fn name(self) -> &'static str {
        match self {
            HashAlgorithm::Carp => "carp",
            HashAlgorithm::Prac => "prac",
            HashAlgorithm::Jarh => "jarh",
        }
    }
}

/// Admin HTTP API and /metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct Admin {
    /// `None` disables the admin listener (`listen: null`).
    pub listen: Option<SocketAddr>,
    pub token: Option<String>,
}

impl Default for Admin {
    fn default() -> Self {
        Admin {
            listen: Some(SocketAddr::from(([127, 0, 0, 1], 9090))),
            token: None,
        }
    }
}

/// Log output.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Logging {
    pub format: LogFormat,
    /// An EnvFilter directive such as `info` or `fulcrum=debug`; `RUST_LOG` overrides it.
    pub level: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// A health monitor (README.md, "Health monitors").
#[derive(Debug, Clone, PartialEq)]
pub struct Monitor {
    pub name: String,
    pub kind: MonitorKind,
    pub interval: Duration,
    pub timeout: Duration,
    pub failures_to_down: u32,
    pub successes_to_up: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub enum MonitorKind {
    /// SIP OPTIONS over the service's transport; a final response other than 5xx and 408 is
    /// alive unless `expect_codes` is non-empty, and a 503 with Retry-After holds the
    /// service DOWN for it (`health::answer`).
    SipOptions {
        expect_codes: Vec<u16>,
    },
    TcpConnect,
    /// Send `send`, expect a reply that contains `expect` (any reply when `None`).
    Udp {
        send: Vec<u8>,
        expect: Option<Vec<u8>>,
    },
    /// GET `path`, expect one of `expect_codes` (200 when empty).
    Http {
        path: String,
        expect_codes: Vec<u16>,
    },
    /// ICMP echo (RFC 792; ICMPv6 echo, RFC 4443 §4) to the service's address: the one probe
    /// a firewall leg of a packet vserver answers (docs/firewall.md).
    Icmp,
}

/// Transport a service speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Protocol {
    SipUdp,
    SipTcp,
    /// SIP over TLS: the sip-tcp data path on TLS streams (docs/tls.md).
    SipTls,
    /// SIP over WebSocket (RFC 7118): browsers' softphones; vservers only.
    SipWs,
    /// SIP over secure WebSocket (WebSocket on TLS); vservers only.
    SipWss,
    Udp,
    Tcp,
    Http,
    /// Packets forwarded unchanged at the IP layer, only the Ethernet addresses rewritten:
    /// a pool of firewalls or other routers (docs/firewall.md).
    Ip,
}

impl Protocol {
    pub const ALL: [(&'static str, Protocol); 9] = [
        ("sip-udp", Protocol::SipUdp),
        ("sip-tcp", Protocol::SipTcp),
        ("sip-tls", Protocol::SipTls),
        ("sip-ws", Protocol::SipWs),
        ("sip-wss", Protocol::SipWss),
        ("udp", Protocol::Udp),
        ("tcp", Protocol::Tcp),
        ("http", Protocol::Http),
        ("ip", Protocol::Ip),
    ];

    pub fn name(self) -> &'static str {
        match self {
            Protocol::SipUdp => "sip-udp",
            Protocol::SipTcp => "sip-tcp",
            Protocol::SipTls => "sip-tls",
            Protocol::SipWs => "sip-ws",
            Protocol::SipWss => "sip-wss",
            Protocol::Udp => "udp",
            Protocol::Tcp => "tcp",
            Protocol::Http => "http",
            Protocol::Ip => "ip",
        }
    }

    pub fn is_sip(self) -> bool {
        matches!(
            self,
            Protocol::SipUdp
                | Protocol::SipTcp
                | Protocol::SipTls
                | Protocol::SipWs
                | Protocol::SipWss
        )
    }

    /// SIP over a connection (TCP, TLS, WebSocket): one data path, the stream vservers'.
    pub fn is_sip_stream(self) -> bool {
        matches!(
            self,
            Protocol::SipTcp | Protocol::SipTls | Protocol::SipWs | Protocol::SipWss
        )
    }

    /// SIP over WebSocket, plain or secure: a client-side protocol only (browsers connect
    /// to fulcrum; services are reached over sip-udp, sip-tcp or sip-tls).
    pub fn is_websocket(self) -> bool {
        matches!(self, Protocol::SipWs | Protocol::SipWss)
    }

    /// Forwarded packet by packet in the kernel, no socket of fulcrum's on the path
    /// (docs/firewall.md).
    pub fn is_packet(self) -> bool {
        self == Protocol::Ip
    }

    pub fn is_datagram(self) -> bool {
        matches!(self, Protocol::SipUdp | Protocol::Udp)
    }

    /// Protocols whose vservers may terminate and whose services may originate TLS
    /// (`tls`, docs/tls.md). A stream protocol opts in here once its data path carries a
    /// [`crate::tls::MaybeTls`] stream.
    pub fn takes_tls(self) -> bool {
        matches!(
            self,
            Protocol::Tcp | Protocol::Http | Protocol::SipTls | Protocol::SipWss
        )
    }

    /// Protocols that cannot run without `tls`: a sip-tls vserver terminates it, a sip-tls
    /// service is reached through it.
    pub fn needs_tls(self) -> bool {
        matches!(self, Protocol::SipTls | Protocol::SipWss)
    }
}

/// A file the config names, with where it names it: a problem found reading the file is
/// reported at that line and column. Compared by path only (moving the line is no change).
#[derive(Debug, Clone)]
pub struct ConfigFile {
    /// As written, then (by [`crate::config::load`]) resolved against the config file's
    /// directory when relative.
    pub path: PathBuf,
    pub pos: Pos,
    /// Dotted field path, e.g. `vservers[0].tls.cert`.
    pub field: String,
}

impl PartialEq for ConfigFile {
    fn eq(&self, other: &Self) -> bool {
        self.path == other.path
    }
}

/// A vserver's `tls`: terminate TLS with this certificate (docs/tls.md).
#[derive(Debug, Clone, PartialEq)]
pub struct VserverTls {
    /// PEM certificate chain, end-entity first.
    pub cert: ConfigFile,
    /// PEM private key of the certificate.
    pub key: ConfigFile,
    /// PEM CA certificates: clients must present a certificate they issued (mutual TLS).
    pub client_ca: Option<ConfigFile>,
    /// `tls_handshake_timeout`: a handshake not finished by then is dropped and counted.
    pub handshake_timeout: Duration,
    /// The rustls configuration built from the files ([`crate::config::load`]).
    pub loaded: crate::tls::Loaded<rustls::ServerConfig>,
}

impl VserverTls {
    /// What the listener hands to new handshakes; `None` when the files were not loaded.
    pub fn server_tls(&self) -> Option<crate::tls::ServerTls> {
        self.loaded.get().map(|c| crate::tls::ServerTls {
            config: std::sync::Arc::clone(c),
            handshake_timeout: self.handshake_timeout,
            fingerprint: self.loaded.fingerprint(),
        })
    }
}

/// A service's `tls`: originate TLS toward it (docs/tls.md).
#[derive(Debug, Clone, PartialEq)]
pub struct ServiceTls {
    /// PEM CA certificates the service's certificate must chain to.
    pub ca: ConfigFile,
    /// SNI and the name checked in the service's certificate; the service's IP when `None`.
    pub server_name: Option<String>,
    /// A client certificate and key, for a service that asks for one.
    pub cert: Option<ConfigFile>,
    pub key: Option<ConfigFile>,
    /// The rustls configuration built from the files ([`crate::config::load`]).
    pub loaded: crate::tls::Loaded<rustls::ClientConfig>,
}

impl ServiceTls {
    /// What a connector to the service at `host` hands to new handshakes; `None` when the
    /// files were not loaded.
    pub fn client_tls(&self, host: IpAddr) -> Option<crate::tls::ClientTls> {
        let config = std::sync::Arc::clone(self.loaded.get()?);
        let server_name = crate::tls::server_name(self.server_name.as_deref(), host)?;
        Some(crate::tls::ClientTls {
            config,
            server_name,
        })
    }
}

/// One backend endpoint (docs/config.md, Model).
#[derive(Debug, Clone, PartialEq)]
pub struct Service {
    pub name: String,
    /// Port 0 for a `protocol: ip` service, whose `address` is an IP alone.
    pub address: SocketAddr,
    pub protocol: Protocol,
    /// 1..=100, default 1.
    pub weight: u32,
    /// Index into [`Config::monitors`].
    pub monitor: Option<usize>,
    /// 0 = unlimited.
    pub max_clients: u32,
    /// Hashing identity; when `None`, the service hashes as its address.
    pub hash_id: Option<String>,
    /// Originate TLS toward the service (`None`: plain).
    pub tls: Option<ServiceTls>,
    /// sip-tcp / sip-tls: a write toward the service that makes no progress this long ends
    /// the connection and counts as the service's failure (default 5 s).
    pub write_timeout: Duration,
    /// In the backup tier: given new flows only while every other member of the vserver is
    /// unusable (docs/methods.md, Tiers).
    pub backup: bool,
    /// `dns`: a pool published in DNS (docs/discovery.md). In the file's config such a
    /// service stands for its members (its `address` is a placeholder, the unspecified
    /// address); the running config has in its place one service per member found
    /// ([`crate::discovery::expand`]).
    pub dns: Option<DnsName>,
    /// The SRV priority of a member found through SRV records (`None` otherwise).
    pub priority: Option<u16>,
    /// `interface` of a `protocol: ip` service: the link its address is reached on, where
    /// its Ethernet address is resolved (`None` for every other protocol).
    pub interface: Option<String>,
}

impl Service {
    /// The service's tier: lower is better; a vserver gives new flows to the best tier with
    /// a usable member (docs/methods.md, Tiers). Static services are tier 0, `backup: true`
    /// puts a service below every priority (65,536), and a member found through SRV records
    /// is at its priority (within the backup range when its pool says `backup: true`).
    pub fn tier(&self) -> u32 {
        (u32::from(self.backup) << 16) | u32::from(self.priority.unwrap_or(0))
    }
}

/// The default `write_timeout` of a service.
pub const DEFAULT_WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// Load-balancing method (docs/methods.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Method {
    RoundRobin,
    LeastConnection,
    LeastResponseTime,
    LeastBandwidth,
    LeastPackets,
    Lrtm,
    CustomLoad,
    UrlHash,
    DomainHash,
    DestIpHash,
    SourceIpHash,
    SourceDestIpHash,
    SourceIpSourcePortHash,
    CallIdHash,
    AorHash,
    Token,
}

impl Method {
    pub const ALL: [(&'static str, Method); 16] = [
        ("round_robin", Method::RoundRobin),
        ("least_connection", Method::LeastConnection),
        ("least_response_time", Method::LeastResponseTime),
        ("least_bandwidth", Method::LeastBandwidth),
        ("least_packets", Method::LeastPackets),
        ("lrtm", Method::Lrtm),
        ("custom_load", Method::CustomLoad),
        ("url_hash", Method::UrlHash),
        ("domain_hash", Method::DomainHash),
        ("dest_ip_hash", Method::DestIpHash),
        ("source_ip_hash", Method::SourceIpHash),
        ("source_dest_ip_hash", Method::SourceDestIpHash),
        ("source_ip_source_port_hash", Method::SourceIpSourcePortHash),
        ("call_id_hash", Method::CallIdHash),
        ("aor_hash", Method::AorHash),
        ("token", Method::Token),
    ];

    pub fn name(self) -> &'static str {
        Method::ALL
            .iter()
            .find(|(_, m)| *m == self)
            .map_or("?", |(n, _)| n)
    }

    /// Hash methods rank services by a key; the others read per-service counters.
    pub fn is_hash(self) -> bool {
        matches!(
            self,
            Method::UrlHash
                | Method::DomainHash
                | Method::DestIpHash
                | Method::SourceIpHash
                | Method::SourceDestIpHash
                | Method::SourceIpSourcePortHash
                | Method::CallIdHash
                | Method::AorHash
                | Method::Token
        )
    }

    /// Methods fed by samples of the relayed traffic itself (bytes, packets, response
    /// times): a relay that does not see the bytes cannot serve them.
    pub fn samples_traffic(self) -> bool {
        matches!(
            self,
            Method::LeastResponseTime
                | Method::Lrtm
                | Method::LeastBandwidth
                | Method::LeastPackets
        )
    }
}

/// Where the `token` method takes its key from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenRule {
    /// A SIP or HTTP header (case-insensitive name).
    Header(String),
    /// An HTTP (or SIP Request-URI) query parameter.
    Query(String),
    /// `length` bytes of the TCP/UDP payload starting at `offset`.
    Payload { offset: usize, length: usize },
}

/// Parameters of the hash methods.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HashParams {
    /// 1..=4096, default 80 (url_hash, domain_hash).
    pub hash_length: usize,
    /// IPv4 mask for IP hashes, default 255.255.255.255.
    pub netmask: Ipv4Addr,
    /// IPv6 prefix length for IP hashes, 0..=128, default 128.
    pub v6_netmask_len: u8,
    pub token: Option<TokenRule>,
    /// Bounded loads: a percentage >= 100; `None` = off.
    pub hash_balance_factor: Option<u32>,
    /// `aor_hash`: what of the address-of-record is hashed.
    pub aor_key: AorKey,
}

/// `aor_key`: the part of an address-of-record `aor_hash` hashes (docs/methods.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AorKey {
    /// The whole AoR in canonical form (RFC 3261 §10.3): user and host.
    #[default]
    Uri,
    /// The user part only, for registrars that ignore the domain (one domain per farm).
    User,
}

impl Default for HashParams {
    fn default() -> Self {
        HashParams {
            hash_length: 80,
            netmask: Ipv4Addr::BROADCAST,
            v6_netmask_len: 128,
            token: None,
            hash_balance_factor: None,
            aor_key: AorKey::Uri,
        }
    }
}

/// Unit of `new_service_request_rate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RateUnit {
    PerSecond,
    Percent,
}

/// Slow start parameters of a vserver (docs/slow_start.md).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlowStart {
    /// 0 = no slow start.
    pub new_service_request_rate: u32,
    pub unit: RateUnit,
    /// Zero = manual mode.
    pub increment_interval: Duration,
}

/// A SIP vserver's `failover`: a request outside a dialog whose service answers a final
/// response in `codes`, or nothing at all within `no_answer`, goes to the next-ranked service,
/// up to `tries` services (docs/sip.md, "Failover").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failover {
    /// Final answers that send the request to the next service.
    pub codes: Vec<u16>,
    /// No response at all (not even 100) to an INVITE within this: the next service.
    pub no_answer: Duration,
    /// The same for other requests; `None` (the default): only a failover code moves them,
    /// since RFC 4320 §4.1 lets a service stay silent until T2 before its 100 (docs/sip.md,
    /// "Failover").
    pub no_answer_non_invite: Option<Duration>,
    /// Most services one request is tried on.
    pub tries: u8,
    /// Most requests held at once; beyond, requests are forwarded statelessly (counted).
    pub max_pending: usize,
    /// Most bytes the held requests may weigh (the request, each attempt's copy, the answers
    /// kept); beyond, requests are forwarded statelessly (counted).
    pub max_pending_bytes: usize,
}

impl Default for Failover {
    fn default() -> Self {
        Failover {
            codes: vec![500, 503, 504],
            no_answer: Duration::from_secs(2),
            no_answer_non_invite: None,
            tries: 3,
            max_pending: 65_536,
            max_pending_bytes: 256 << 20,
        }
    }
}

/// The pool of a routing rule (docs/routing.md): its services, the method that chooses
/// among them (the vserver's when the rule gives none), and its own `hash_length`,
/// `slow_start` and `failover`, each the vserver's when the rule does not give it.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutePool {
    /// The rule's name.
    pub route: String,
    /// Indices into [`Config::services`].
    pub services: Vec<usize>,
    pub method: Option<Method>,
    /// The key length of `url_hash` and `domain_hash` in this pool.
    pub hash_length: usize,
    /// Slow start of the pool's members (non-hash methods only).
    pub slow_start: Option<SlowStart>,
    /// Failover of the requests routed to this pool (`None`: off), never leaving it.
    pub failover: Option<Failover>,
}

/// One listener (docs/config.md, Model).
#[derive(Debug, Clone, PartialEq)]
pub struct Vserver {
    pub name: String,
    pub protocol: Protocol,
    pub bind: Vec<SocketAddr>,
    pub method: Method,
    pub hash: HashParams,
    pub slow_start: Option<SlowStart>,
    /// Indices into [`Config::services`].
    pub services: Vec<usize>,
    /// The protocols of the pools published in DNS (`dns` services) this vserver lists,
    /// whether they have members at the moment or not: the transports bridge sets up its
    /// legs at start for the members they may have later.
    pub discovered: Vec<Protocol>,
    /// Host:port used in Via / Record-Route instead of the bound address (SIP).
    pub advertise: Option<String>,
    /// Add Record-Route to requests (SIP).
    pub record_route: bool,
    /// When a forwarded REGISTER gets fulcrum's Path with a flow token (SIP).
    pub path: PathMode,
    /// `allowed_origins` (sip-ws, sip-wss): the web origins whose pages may open a
    /// WebSocket (`None`: any).
    pub allowed_origins: Option<Vec<String>>,
    /// `service_source` (sip-udp): the address fulcrum sends from toward its services and
    /// names in its Via, so that their answers come back to this instance; port 0 means the
    /// vserver's own (bound) port. `None`: the vserver's sockets, as for clients.
    pub service_source: Option<SocketAddr>,
    /// Idle timeout of sessions / connections / dialog affinity entries.
    pub idle_timeout: Duration,
    /// How long a service removed from this vserver by a reload keeps the flows pinned to it
    /// (draining) before they are cut or routed afresh. Defaults to `idle_timeout`.
    pub drain_timeout: Duration,
    /// `allow`: the networks whose clients may use the vserver (`None`: everyone).
    pub allow: Option<Vec<crate::acl::Cidr>>,
    /// `deny`: networks whose clients may not (deny wins over allow).
    pub deny: Vec<crate::acl::Cidr>,
    /// `flood`: per-source new-request limit and ban (`None`: off).
    pub flood: Option<crate::flood::FloodParams>,
    /// `failover` of requests outside a dialog (SIP vservers; `None`: off, or not SIP).
    pub failover: Option<Failover>,
    /// `eject`: passive ejection of services that fail live requests (`None`: `eject: off`;
    /// docs/ejection.md).
    pub eject: Option<crate::eject::EjectParams>,
    /// Not read from YAML: services removed from this vserver by a reload that still carry
    /// flows there (indices into [`Config::services`], not in `services`). The running proxy
    /// keeps them as members at the end of the vserver's member list, where no new flow is
    /// given to them (see `docs/draining.md`). Always empty in a config read from a file.
    pub draining: Vec<usize>,
    /// Bound of the session / connection / dialog table.
    pub max_sessions: usize,
    /// `max_sessions` was written in the file (an unset one on a udp vserver is clamped to
    /// the open-file pool at start, docs/limits.md).
    pub max_sessions_set: bool,
    /// Concurrent connections from one source (an IPv4 address, an IPv6 /64) on a stream
    /// listener (sip-tcp, sip-tls, tcp, http), or sessions on a udp vserver (off there by
    /// default); `None`: no limit (docs/limits.md).
    pub max_per_source: Option<u32>,
    /// IP_TRANSPARENT toward services (firewall pools).
    pub transparent: bool,
    /// IP_FREEBIND on the listening sockets: bind addresses the host does not hold yet (a
    /// standby's VIP; docs/deployment.md).
    pub freebind: bool,
    /// Send a PROXY protocol header toward services.
    pub send_proxy: Option<ProxyProtocol>,
    /// Worker sockets (SO_REUSEPORT) for datagram vservers; 0 = one per core.
    pub workers: usize,
    /// Terminate TLS on the listener (`None`: plain).
    pub tls: Option<VserverTls>,
    /// `interface` of a `protocol: ip` vserver: the links whose arriving packets it
    /// forwards (empty for every other protocol, which has `bind` instead).
    pub interfaces: Vec<String>,
    /// `sticky` of a `protocol: ip` vserver: a flow keeps its firewall when the pool
    /// changes, instead of following the hash (docs/firewall.md).
    pub sticky: bool,
    /// `routes` and `default` (SIP vservers, docs/routing.md); `None`: every request goes
    /// to the vserver's own pool.
    pub routes: Option<crate::route::Routes>,
    /// The pools of the rules that have one, in file order: pool `k` of
    /// [`crate::route::Target::Pool`] is `route_pools[k - 1]` (pool 0 is `services`).
    pub route_pools: Vec<RoutePool>,
}

impl Vserver {
    /// The vserver's edge protection (access lists and flood table), carrying over bans and
    /// counters from `previous` (the vserver a reload replaces).
    pub fn edge(&self, previous: Option<&crate::edge::Edge>) -> crate::edge::Edge {
        crate::edge::Edge::new(
            crate::acl::Acl::new(self.allow.clone(), self.deny.clone()),
            self.flood,
            previous,
        )
    }

    /// The vserver's members as the running proxy indexes them (indices into
    /// [`Config::services`]): its `services`, then the services still draining there.
    pub fn members(&self) -> impl Iterator<Item = usize> + '_ {
        self.services
            .iter()
            .copied()
            .chain(self.pool_only())
            .chain(self.draining.iter().copied())
    }

    /// The services only routing rules' pools list (not in `services`), in the order they
    /// first appear: members after the vserver's own, before the draining ones.
    pub fn pool_only(&self) -> Vec<usize> {
        let mut out: Vec<usize> = Vec::new();
        for s in self.route_pools.iter().flat_map(|p| &p.services) {
            if !self.services.contains(s) && !out.contains(s) {
                out.push(*s);
            }
        }
        out
    }

    /// Whether the vserver forwards to a service whose protocol passes `p`: a member, or a
    /// pool in DNS it lists, members found or not (the transports bridge sets up its legs
    /// at start for what the pool may bring later).
    pub fn forwards_to(&self, config: &Config, p: impl Fn(Protocol) -> bool) -> bool {
        self.members()
            .filter_map(|i| config.services.get(i))
            .map(|s| s.protocol)
            .chain(self.discovered.iter().copied())
            .any(p)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyProtocol {
    V2,
}
