//! fulcrum — a SIP-aware UDP/TCP load-balancing proxy.
//!
//! # Layout
//! A pure decision core (no sockets, no clock, no randomness) inside an I/O shell.
//!
//! - `acl`        PURE  allow / deny CIDR lists of a vserver
//! - `admin`      IO    admin HTTP API: socket-free router over `Ops`, hyper HTTP/1.1 server, /metrics, dashboard page
//! - `bpf`        IO    packet vservers' kernel side: tc ingress program (assembled in Rust), maps, tcx links; unsafe in `bpf::sys` only
//! - `balancer`   PURE  one vserver's decision: hash ranking, fallbacks, methods, slow start
//! - `capture`    IO    SIP messages to a HEP collector: bounded queue, one sender thread (`capture::hep`: the packets, PURE)
//! - `client_hello` PURE TLS ClientHello's server name and ALPN protocols, to route TLS without terminating it
//! - `config`     PURE  YAML model, validation with field paths and line numbers
//! - `core`       PURE  the data paths' decisions: the SIP proxy core, SIP stream link and receive buffer, udp sessions, tcp keys
//! - `demo`       IO    `fulcrum demo`: built-in SIP backends, proxy and load on loopback
//! - `dialog`     PURE  Call-ID → service affinity table with idle expiry (time passed in)
//! - `drain`      PURE  services a reload removed, kept while their flows finish
//! - `discovery`  PURE  pools published in DNS: answers -> member sets, refresh times, the expanded config (`discovery::resolve`: the lookups, IO)
//! - `edge`       PURE  a vserver's access lists, flood table and drop counters
//! - `eject`      PURE  passive ejection: a service's failures in a row eject it for a while, half-open trials, max_fraction
//! - `fd_limit`   IO    the open-file limit raised once per process, divided into the `budget`; start warnings when vservers could need more
//! - `flood`      PURE  per-source new-request limits and bans in a fixed-size table
//! - `hash`       PURE  fixed, seeded hash functions: keys, service identities, carp combine
//! - `health`     IO    monitors: probes on tokio (SIP OPTIONS, TCP, UDP, HTTP, ICMP echo) around the PURE `health::state` machine, `health::answer` judgement and `health::icmp` echo matching
//! - `http`       PURE  first HTTP/1.x request head: target, Host, headers, query
//! - `key`        PURE  hash method -> key from a request context (addresses + payload view)
//! - `liveness`   PURE  whether every worker still makes progress, for the watchdog; IO edge: the looks at each worker's heart
//! - `memory`     PURE  when to give freed heap memory back after connections close; IO edge asks jemalloc to purge
//! - `methods`    PURE  non-hash methods (round robin, least connection, ...) over the counters
//! - `net`        IO    SO_REUSEPORT worker sockets, IP_FREEBIND
//! - `ops`        IO    the running proxy as the operator sees it: status, disable, reload, drain
//! - `packet`     PURE  packet vservers (firewall pools): frame → flow → fixed hash → bucket, bucket table from a selector; the program's twin
//! - `peer`       IO    minimal SIP UAS / UAC for the demo and socket tests
//! - `proxy`      IO    data paths (sip-udp, sip-tcp, udp, tcp, http) around `core`, the runtime that starts vservers (a packet vserver through `proxy::packet`), in-place rebuild on reload
//! - `readiness`  PURE  whether the instance should get new traffic (`/readyz`): vserver facts + drain -> verdict
//! - `reload`     PURE  what a reload changes in place, and what needs a restart
//! - `route`      PURE  routing rules of a vserver (SIP requests, tcp connections by TLS name and protocol, HTTP requests): the pool or refusal each gets
//! - `select`     PURE  consistent-hash selectors carp, prac, jarh: ranking and UP/eligible filtering
//! - `session`    PURE  UDP session table: bounded, idle expiry with `now` passed in
//! - `simulate`   PURE  `fulcrum simulate` engines driving the real core with simulated time; `fulcrum route` and `POST /vservers/NAME/route` (`simulate::route`)
//! - `sip`        PURE  zero-copy SIP scanner, stateless-proxy rewrite, TCP stream framing
//! - `slow_start` PURE  slow-start state machine driven by injected time
//! - `stats`      PURE  per-service atomic counters (connections, rates, response times, load)
//! - `sync`       PURE  `lock`: a mutex guard that recovers from poison (why it may)
//! - `systemd`    PURE  service-manager notify messages (READY, RELOADING, STOPPING, watchdog); IO edge sends them
//! - `tls`        IO    rustls configurations from PEM files, reloadable listener / connector, handshake failure reasons (PURE)
//! - `victims`    PURE  idle clients ordered for eviction (class, last activity): a priority queue re-keyed lazily
//! - `uring`      IO    batched sends on many sockets in one system call (io_uring); `unsafe` here, in `memory::release` and `bpf::sys` only
// Denied everywhere but in `uring`, `memory::release` and `bpf::sys`, which document why their blocks are sound.
#![deny(unsafe_code)]
// Public means used by the binaries, benches, examples, fuzz targets or integration tests.
#![warn(unreachable_pub)]

pub mod acl;
pub mod admin;
pub mod balancer;
pub mod bpf;
pub mod budget;
pub mod capture;
pub mod client_hello;
pub mod config;
pub mod core;
pub mod demo;
pub(crate) mod dialog;
pub mod discovery;
pub(crate) mod drain;
pub(crate) mod edge;
pub mod eject;
pub mod fd_limit;
pub(crate) mod flood;
pub mod hash;
pub mod health;
pub mod http;
pub mod key;
pub mod liveness;
pub mod memory;
pub mod methods;
pub(crate) mod net;
pub mod ops;
pub mod packet;
pub mod peer;
pub mod proxy;
pub(crate) mod readiness;
pub mod reload;
pub mod route;
pub mod select;
pub(crate) mod session;
pub mod simulate;
pub mod sip;
pub mod slow_start;
pub mod stats;
mod sync;
pub mod systemd;
pub mod tls;
pub mod uring;
pub mod victims;
