//! SIP messages to a HEP collector (Homer's heplify-server, sngrep, Kamailio's sipcapture;
//! docs/capture.md). IO, around the PURE packet writer [`hep`].
//!
//! Never on the call path: a data path hands each message to [`Capture::tap`], which writes
//! its HEP packet straight into a bounded queue of bytes (the message's one copy) without
//! waiting: a full queue drops it, counted. One sender thread per configuration takes the
//! whole queue every few milliseconds and sends it at once: one `sendmmsg` per 64 packets
//! toward a UDP collector, one write of every packet toward a TCP one. While the collector is
//! known to be down (a UDP send refused, no TCP connection) the taps drop at once, counted,
//! before any clock read or copy. A slow or dead collector costs capture packets, never a SIP
//! message or a stall. With capture off, a tap is one atomic load and a branch.

pub mod hep;
mod send_queue;

use crate::config::{CaptureTransport, HepCapture};
use arc_swap::ArcSwapOption;
use nix::sys::socket::{MsgFlags, MultiHeaders, SockaddrStorage, sendmmsg};
use std::io::{IoSlice, Write as _};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::os::fd::AsRawFd as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub use hep::Transport;

/// Bytes of packets waiting for the sender at most (SIP over a stream may be 64 KiB a
/// message): past it packets are dropped. The sender holds one more such batch while it
/// sends it.
pub const QUEUE_BYTES: usize = 8 << 20;

/// How long a write to a TCP collector may block the sender before the connection is
/// given up (a collector that stops reading).
const TCP_WRITE_TIMEOUT: Duration = Duration::from_secs(1);
const TCP_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Reconnection backoff of the TCP transport: doubled after each failure, up to the cap.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A TCP connection this old that still takes writes resets the backoff: a connection that
/// fails sooner (a write timeout) is retried less and less often.
const TCP_PROVEN_AFTER: Duration = Duration::from_secs(10);
/// How long the taps drop toward a UDP collector after a refused send (ICMP port
/// unreachable) before packets are offered again.
const UDP_RETRY_AFTER: Duration = Duration::from_secs(1);
/// How long a UDP collector shows as down after a refused send.
const UDP_DOWN_FOR: Duration = Duration::from_secs(5);
/// How often the sender takes the queue: the delay of a captured message at most, and what
/// makes its sends batches (at 50,000 packets a second, 250 a batch).
const NAP: Duration = Duration::from_millis(5);
/// How often while the collector is known to be down (the taps queue nothing): the delay of
/// a retry at most.
const NAP_DOWN: Duration = Duration::from_millis(50);
/// Packets per `sendmmsg` toward a UDP collector.
const UDP_BATCH: usize = 64;
/// Datagrams per UDP GSO send (the kernel's `UDP_MAX_SEGMENTS` was 64 before Linux 6.9).
const GSO_SEGMENTS: usize = 64;
/// Bytes per UDP GSO send at most: one IP packet's payload, with room for the headers.
const GSO_BYTES: usize = 65_000;
/// The MTU assumed when the socket does not say its path's: Ethernet's.
const GSO_MTU: usize = 1_500;
/// A sender's buffer larger than this after a burst is given back.
const KEEP_BYTES: usize = 1 << 20;
/// Drops are logged at most this often.
const LOG_EVERY: Duration = Duration::from_secs(60);

/// The counters of capture, kept across reloads (metrics and `/status` read them).
#[derive(Debug, Default)]
pub struct CaptureStats {
    pub sent: AtomicU64,
    /// The queue was full (the sender or the collector too slow).
    pub dropped_queue_full: AtomicU64,
    /// Larger than one HEP packet can carry (16-bit length).
    pub dropped_too_big: AtomicU64,
    /// The collector could not be written to (unreachable, not connected, write failed).
    pub dropped_send_error: AtomicU64,
}

impl CaptureStats {
    /// `(reason, count)` of every drop reason, as the metrics label them.
    pub fn dropped(&self) -> [(&'static str, u64); 3] {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        [
            ("queue_full", l(&self.dropped_queue_full)),
            ("too_big", l(&self.dropped_too_big)),
            ("send_error", l(&self.dropped_send_error)),
        ]
    }

    fn dropped_total(&self) -> u64 {
        self.dropped().iter().map(|d| d.1).sum()
    }
}

/// When a message crossed the wire, in the collector's terms (Unix time): taken by a data
/// path right after its receive or right before its send, so that the times of a forwarded
/// message's two legs, and of a request and its answer, keep their causal order. `None`:
/// not taken, the collector was known to be down ([`Tap::stamp`]), so the message is dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp(Option<Duration>);

impl Stamp {
    pub fn now() -> Stamp {
        Stamp(Some(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default(),
        ))
    }

    /// The stamp of a message the collector cannot take: no clock read.
    const DOWN: Stamp = Stamp(None);

    /// Whether the time was taken: the collector was not known to be down, so the message
    /// is likely to be queued (work only capture needs is worth doing for it).
    pub fn is_taken(self) -> bool {
        self.0.is_some()
    }
}

/// A captured message's Call-ID (the packet's correlation id), as its caller knows it: a
/// data path that captures a message and what it forwards of it finds the Call-ID once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallId<'a> {
    /// Found in the message when its packet is written ([`call_id_of`]).
    Find,
    /// The message's Call-ID (`None`: it has none), which the caller vouches for.
    Is(Option<&'a [u8]>),
}

/// [`CallId`] owned: for a message that waits in a queue before the tap of its send (a
/// stream's write queues), the Call-ID its queuer knew, copied once.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum CallIdBuf {
    /// [`CallId::Find`].
    #[default]
    Find,
    /// [`CallId::Is`].
    Is(Option<Arc<[u8]>>),
}

impl CallIdBuf {
    /// `call_id` copied (a few dozen bytes, one allocation; none for [`CallId::Find`] or a
    /// message without a Call-ID).
    pub fn of(call_id: CallId<'_>) -> CallIdBuf {
        match call_id {
            CallId::Find => CallIdBuf::Find,
            CallId::Is(c) => CallIdBuf::Is(c.map(Arc::from)),
        }
    }

    pub fn as_call_id(&self) -> CallId<'_> {
        match self {
            CallIdBuf::Find => CallId::Find,
            CallIdBuf::Is(c) => CallId::Is(c.as_deref()),
        }
    }
}

/// Whether the taps queue packets, as one word the taps read and each configuration's sender
/// writes: the configuration's generation shifted left by one, and the low bit set while its
/// collector is not known to be down. A sender of an older generation (one still ending after
/// a reload) cannot change the word of a newer one.
#[derive(Debug, Default)]
struct Gate(AtomicU64);

impl Gate {
    fn is_open(&self) -> bool {
        self.0.load(Ordering::Relaxed) & 1 == 1
    }

    /// A new generation (closed when `open` is false); returns it.
    fn renew(&self, open: bool) -> u64 {
        let generation = (self.0.load(Ordering::Relaxed) >> 1) + 1;
        self.0
            .store(generation << 1 | u64::from(open), Ordering::Relaxed);
        generation
    }

    /// Open or close the gate if `generation` is still the current one.
    fn set(&self, generation: u64, open: bool) {
        let want = generation << 1 | u64::from(open);
        let mut cur = self.0.load(Ordering::Relaxed);
        while cur >> 1 == generation && cur != want {
            match self
                .0
                .compare_exchange_weak(cur, want, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return,
                Err(now) => cur = now,
            }
        }
    }
}

/// What the taps of one configuration and its sender share.
#[derive(Debug, Default)]
struct Shared {
    /// HEP packets back to back, oldest first ([`hep::packets`] splits them).
    queue: Mutex<Vec<u8>>,
    /// The process's gate, which this configuration's sender closes while the collector is
    /// known to be down (the taps drop at once), and the generation it may set.
    gate: Arc<Gate>,
    generation: u64,
    /// Set by this configuration's own sender (an old sender still ending cannot touch it):
    /// the collector is reachable, the last UDP sends went out or a TCP connection is open.
    connected: AtomicBool,
}

impl Shared {
    fn queue(&self) -> MutexGuard<'_, Vec<u8>> {
        // A panic while a tap held the lock leaves whole packets or a cut one at the end,
        // which `hep::packets` stops at: the bytes are still usable.
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The running configuration: the queue to its sender thread and what it captures.
struct Exporter {
    shared: Arc<Shared>,
    vservers: Option<Vec<String>>,
    probes: bool,
    config: HepCapture,
}

/// The process's capture: off, or one exporter; swapped by a reload.
#[derive(Default)]
pub struct Capture {
    exporter: ArcSwapOption<Exporter>,
    /// Whether `exporter` holds one: what [`Tap::stamp`] reads per message, cheaper than a
    /// load of the exporter.
    on: AtomicBool,
    /// Whether the exporter's collector takes packets: read by [`Tap::stamp`] before the
    /// clock, and by a tap before anything else.
    gate: Arc<Gate>,
    /// Whether the exporter captures only some vservers (`vservers`): a tap dropping for a
    /// down collector needs no load of the exporter otherwise.
    filtered: AtomicBool,
    stats: Arc<CaptureStats>,
}

impl std::fmt::Debug for Capture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Capture")
            .field("config", &self.config())
            .finish_non_exhaustive()
    }
}

impl Capture {
    /// Capture as `config` says (`None`: off).
    pub fn new(config: Option<&HepCapture>) -> Capture {
        let c = Capture::default();
        c.configure(config);
        c
    }

    /// Apply a (re)loaded configuration: an unchanged one keeps its sender; a changed one
    /// starts a new sender and the old one ends once its queue is empty; `None` turns
    /// capture off.
    pub fn configure(&self, config: Option<&HepCapture>) {
        let current = self.exporter.load();
        if current.as_ref().map(|e| &e.config) == config {
            return;
        }
        let generation = self.gate.renew(config.is_some());
        let next = config.map(|c| {
            let shared = Arc::new(Shared {
                queue: Mutex::default(),
                gate: Arc::clone(&self.gate),
                generation,
                connected: AtomicBool::new(false),
            });
            let stats = Arc::clone(&self.stats);
            let sender_shared = Arc::clone(&shared);
            let sender_config = c.clone();
            let spawned = std::thread::Builder::new()
                .name("fulcrum-capture".into())
                .spawn(move || send_loop(&sender_config, &sender_shared, &stats));
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "capture: cannot start the sender thread; capture is off");
                shared.gate.set(generation, false);
            }
            Arc::new(Exporter {
                shared,
                vservers: c.vservers.clone(),
                probes: c.probes,
                config: c.clone(),
            })
        });
        let on = next.is_some();
        let filtered = config.is_some_and(|c| c.vservers.is_some());
        self.exporter.store(next);
        self.filtered.store(filtered, Ordering::Relaxed);
        self.on.store(on, Ordering::Relaxed);
        tracing::info!(collector = ?config.map(|c| c.address), "capture configured");
    }

    /// The configuration in force.
    pub fn config(&self) -> Option<HepCapture> {
        self.exporter.load().as_ref().map(|e| e.config.clone())
    }

    pub fn stats(&self) -> &CaptureStats {
        &self.stats
    }

    /// Whether the collector in force is reachable (false while capture is off).
    pub fn is_connected(&self) -> bool {
        self.exporter
            .load()
            .as_ref()
            .is_some_and(|e| e.shared.connected.load(Ordering::Relaxed))
    }

    /// Whether capture is on at all (a cheap check before work only capture needs).
    pub fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Capture `payload`, a SIP message vserver `vserver` received or sent `at` on `transport`
    /// from `src` to `dst` (as on the wire for that leg). Never blocks.
    pub fn tap(
        &self,
        vserver: &str,
        at: Stamp,
        transport: Transport,
        src: SocketAddr,
        dst: SocketAddr,
        payload: &[u8],
    ) {
        self.tap_as(vserver, at, (transport, src, dst), payload, CallId::Find);
    }

    /// [`Capture::tap`] of a message whose Call-ID the caller knows.
    pub fn tap_as(
        &self,
        vserver: &str,
        at: Stamp,
        (transport, src, dst): (Transport, SocketAddr, SocketAddr),
        payload: &[u8],
        call_id: CallId<'_>,
    ) {
        // A keep-alive (CRLF, RFC 5626 §3.5.1) is no SIP message.
        if !payload.first().is_some_and(u8::is_ascii_alphabetic) {
            return;
        }
        // The collector is down: counted without a look at the configuration when it
        // captures every vserver.
        if at == Stamp::DOWN && !self.filtered.load(Ordering::Relaxed) {
            if self.is_on() {
                self.dropped_down();
            }
            return;
        }
        let guard = self.exporter.load();
        let Some(e) = guard.as_ref() else {
            return;
        };
        if let Some(only) = &e.vservers
            && !only.iter().any(|n| n == vserver)
        {
            return;
        }
        self.offer(e, at, (transport, src, dst), payload, call_id);
    }

    /// Capture a health monitor's SIP probe or its answer, when `probes` is on.
    pub fn tap_probe(
        &self,
        at: Stamp,
        transport: Transport,
        src: SocketAddr,
        dst: SocketAddr,
        payload: &[u8],
    ) {
        let guard = self.exporter.load();
        if let Some(e) = guard.as_ref().filter(|e| e.probes) {
            self.offer(e, at, (transport, src, dst), payload, CallId::Find);
        }
    }

    /// One message dropped because the collector is known to be down.
    fn dropped_down(&self) {
        self.stats
            .dropped_send_error
            .fetch_add(1, Ordering::Relaxed);
    }

    /// The packet of one message into the queue, or one counted drop.
    fn offer(
        &self,
        e: &Exporter,
        at: Stamp,
        (transport, src, dst): (Transport, SocketAddr, SocketAddr),
        payload: &[u8],
        call_id: CallId<'_>,
    ) {
        let Some(t) = at.0.filter(|_| self.gate.is_open()) else {
            self.dropped_down();
            return;
        };
        let leg = hep::Leg {
            transport,
            src,
            dst,
            time_s: t.as_secs() as u32,
            time_us: t.subsec_micros(),
        };
        let auth = e.config.password.as_deref().map(str::as_bytes);
        let call_id = match call_id {
            CallId::Find => call_id_of(payload),
            CallId::Is(c) => {
                debug_assert_eq!(c, call_id_of(payload), "a handed Call-ID is the message's");
                c
            }
        };
        let len = hep::packet_len(&leg, auth, call_id, payload);
        if len > hep::MAX_PACKET {
            self.stats.dropped_too_big.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let mut queue = e.shared.queue();
        if queue.len() + len > QUEUE_BYTES
            || hep::append(&leg, e.config.id, auth, call_id, payload, &mut queue).is_err()
        {
            drop(queue);
            self.stats
                .dropped_queue_full
                .fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// How much of a batch went out.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Sent {
    sent: u64,
    failed: u64,
}

/// Where the packets go: a UDP socket connected to the collector, or a TCP connection
/// (re)opened with backoff.
enum Link {
    Udp {
        socket: Option<UdpSocket>,
        headers: MultiHeaders<SockaddrStorage>,
        /// When a send was last refused.
        refused_at: Option<Instant>,
        /// UDP GSO sends (`udp_gso`), until the kernel refuses one.
        gso: Option<Gso>,
    },
    Tcp {
        stream: Option<(TcpStream, Instant)>,
        next_try: Instant,
        backoff: Duration,
        /// The collector's receive window was closed at the last look: it stopped reading.
        stalled: bool,
    },
}

impl Link {
    fn new(c: &HepCapture) -> Link {
        match c.transport {
            CaptureTransport::Udp => {
                let local: SocketAddr = if c.address.is_ipv4() {
                    (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
                } else {
                    (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
                };
                let s = UdpSocket::bind(local).and_then(|s| s.connect(c.address).map(|()| s));
                let socket = s
                    .inspect_err(|e| tracing::warn!(collector = %c.address, error = %e, "capture: cannot set up the UDP socket"))
                    .ok();
                // The path's MTU (loopback's is 64 KiB): how large a GSO segment may be.
                let max_size = socket
                    .as_ref()
                    .and_then(|s| {
                        nix::sys::socket::getsockopt(s, nix::sys::socket::sockopt::IpMtu).ok()
                    })
                    .and_then(|mtu| usize::try_from(mtu).ok())
                    .unwrap_or(GSO_MTU)
                    .saturating_sub(if c.address.is_ipv4() { 20 + 8 } else { 40 + 8 });
                Link::Udp {
                    socket,
                    headers: MultiHeaders::preallocate(UDP_BATCH, None),
                    refused_at: None,
                    gso: c.udp_gso.then(|| Gso {
                        max_size,
                        padded: Vec::new(),
                    }),
                }
            }
            CaptureTransport::Tcp => Link::Tcp {
                stream: None,
                next_try: Instant::now(),
                backoff: BACKOFF_MIN,
                stalled: false,
            },
        }
    }

    /// Bring the link up if it is down and due, and say whether packets may be queued for
    /// it (`open`) and whether the collector counts as reachable (`connected`).
    fn tend(&mut self, c: &HepCapture, now: Instant) -> (bool, bool) {
        match self {
            Link::Udp {
                socket, refused_at, ..
            } => {
                let since = refused_at.map(|t| now.saturating_duration_since(t));
                let open = socket.is_some() && since.is_none_or(|d| d >= UDP_RETRY_AFTER);
                let connected = socket.is_some() && since.is_none_or(|d| d >= UDP_DOWN_FOR);
                (open, connected)
            }
            Link::Tcp {
                stream,
                next_try,
                backoff,
                stalled,
            } => {
                if stream.is_none() && now >= *next_try {
                    match TcpStream::connect_timeout(&c.address, TCP_CONNECT_TIMEOUT) {
                        Ok(s) => {
                            let _ = s.set_write_timeout(Some(TCP_WRITE_TIMEOUT));
                            let _ = s.set_nodelay(true);
                            tracing::info!(collector = %c.address, "capture: connected");
                            *stream = Some((s, Instant::now()));
                        }
                        Err(e) => {
                            tracing::debug!(collector = %c.address, error = %e, retry_in = ?*backoff, "capture: cannot connect");
                            *next_try = Instant::now() + *backoff;
                            *backoff = (*backoff * 2).min(BACKOFF_MAX);
                        }
                    }
                }
                // A collector that stops reading closes its receive window once its buffer
                // is full: the taps then drop at once, as for a collector that is down,
                // instead of filling the queue and this socket's buffer behind it (and
                // paying a live collector's cost for packets that cannot go). The connection
                // stays: packets flow again as soon as it reads.
                let closed = stream.as_ref().is_some_and(|(s, _)| {
                    send_queue::of(s).is_some_and(|(all, unsent)| peer_window_closed(all, unsent))
                });
                if closed != *stalled {
                    *stalled = closed;
                    if closed {
                        tracing::debug!(collector = %c.address, "capture: the collector's receive window is closed; dropping until it reads");
                    } else {
                        tracing::debug!(collector = %c.address, "capture: the collector reads again");
                    }
                }
                (stream.is_some() && !closed, stream.is_some())
            }
        }
    }

    /// Send the packets of `batch` (back to back, as the taps queued them).
    fn send(&mut self, c: &HepCapture, batch: &[u8]) -> Sent {
        let total = hep::packets(batch).count() as u64;
        match self {
            Link::Udp {
                socket,
                headers,
                refused_at,
                gso,
            } => {
                let Some(s) = socket else {
                    return Sent {
                        sent: 0,
                        failed: total,
                    };
                };
                let fd = s.as_raw_fd();
                let mut sent = 0u64;
                let mut skip = 0;
                if let Some(g) = gso {
                    let all: Vec<&[u8]> = hep::packets(batch).collect();
                    match g.send(s, &all) {
                        (n, GsoEnd::Done) => {
                            return Sent {
                                sent: n,
                                failed: total - n,
                            };
                        }
                        (n, GsoEnd::Refused) => {
                            *refused_at = Some(Instant::now());
                            return Sent {
                                sent: n,
                                failed: total - n,
                            };
                        }
                        (n, GsoEnd::Unsupported(e)) => {
                            tracing::warn!(collector = %c.address, error = %e, "capture: UDP GSO refused by the kernel; sending datagram by datagram");
                            *gso = None;
                            sent = n;
                            skip = n as usize;
                        }
                    }
                }
                // Connected: no address per packet.
                let to: [Option<SockaddrStorage>; UDP_BATCH] = [None; UDP_BATCH];
                let mut packets = hep::packets(batch).skip(skip).peekable();
                while packets.peek().is_some() {
                    let iovs: Vec<[IoSlice<'_>; 1]> = packets
                        .by_ref()
                        .take(UDP_BATCH)
                        .map(|p| [IoSlice::new(p)])
                        .collect();
                    let n = sendmmsg(fd, headers, &iovs, to, [], MsgFlags::empty())
                        .map_or(0, Iterator::count);
                    sent += n as u64;
                    // A connected UDP socket hears the ICMP port unreachable of a collector
                    // that is not listening: a later send fails (or ends a batch early). The
                    // taps then drop the packets of the next second, unsent.
                    if n < iovs.len() {
                        *refused_at = Some(Instant::now());
                        break;
                    }
                }
                Sent {
                    sent,
                    failed: total - sent,
                }
            }
            Link::Tcp {
                stream,
                next_try,
                backoff,
                ..
            } => {
                let Some((s, since)) = stream.as_mut() else {
                    return Sent {
                        sent: 0,
                        failed: total,
                    };
                };
                let mut written = 0;
                let failed = loop {
                    match s.write(&batch[written..]) {
                        Ok(0) => break true,
                        Ok(n) => {
                            written += n;
                            if written == batch.len() {
                                break false;
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(_) => break true,
                    }
                };
                // Packets written whole count as sent; one cut in the middle leaves the
                // stream out of step, so the connection is given up.
                let mut sent = 0u64;
                let mut at = 0;
                for p in hep::packets(batch) {
                    at += p.len();
                    if at > written {
                        break;
                    }
                    sent += 1;
                }
                if failed {
                    tracing::warn!(collector = %c.address, "capture: the collector connection failed or stopped reading; reconnecting");
                    *stream = None;
                    *next_try = Instant::now() + *backoff;
                    *backoff = (*backoff * 2).min(BACKOFF_MAX);
                } else if since.elapsed() >= TCP_PROVEN_AFTER {
                    *backoff = BACKOFF_MIN;
                }
                Sent {
                    sent,
                    failed: total - sent,
                }
            }
        }
    }
}

/// Whether a TCP peer's receive window is closed, from the send queue: bytes wait to be sent
/// and none is in flight. With Nagle off (the sender's `TCP_NODELAY`), only a window too
/// small for them holds sendable bytes back while nothing awaits an acknowledgement
/// (RFC 9293 §3.8.6.1: the peer's buffer is full, its application is not reading). PURE.
fn peer_window_closed(all: i32, unsent: i32) -> bool {
    unsent > 0 && all == unsent
}

/// UDP GSO toward a UDP collector (`udp_gso`): consecutive packets padded to one size and
/// sent as one `UDP_SEGMENT` send, which the kernel cuts into datagrams of that size.
struct Gso {
    /// The largest datagram the path takes unfragmented.
    max_size: usize,
    /// The padded packets of one send.
    padded: Vec<u8>,
}

/// How a batch's GSO sends ended.
enum GsoEnd {
    Done,
    /// The collector refused (ICMP port unreachable).
    Refused,
    /// The kernel refused UDP GSO itself.
    Unsupported(std::io::Error),
}

impl Gso {
    /// Send `packets` in GSO groups; how many went out and how it ended.
    fn send(&mut self, s: &UdpSocket, packets: &[&[u8]]) -> (u64, GsoEnd) {
        let lens: Vec<usize> = packets.iter().map(|p| p.len()).collect();
        let mut at = 0;
        for g in hep::gso_groups(&lens, GSO_SEGMENTS, GSO_BYTES, self.max_size) {
            let run = &packets[at..at + g.count];
            let r = if let [one] = run {
                s.send(one).map(drop)
            } else {
                self.padded.clear();
                for p in run {
                    hep::append_padded(p, g.size, &mut self.padded);
                }
                let seg = u16::try_from(g.size).unwrap_or(u16::MAX);
                nix::sys::socket::sendmsg::<()>(
                    s.as_raw_fd(),
                    &[IoSlice::new(&self.padded)],
                    &[nix::sys::socket::ControlMessage::UdpGsoSegments(&seg)],
                    MsgFlags::empty(),
                    None,
                )
                .map(drop)
                .map_err(std::io::Error::from)
            };
            match r {
                Ok(()) => at += g.count,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    return (at as u64, GsoEnd::Refused);
                }
                Err(e) if g.count > 1 => return (at as u64, GsoEnd::Unsupported(e)),
                Err(_) => return (at as u64, GsoEnd::Refused),
            }
        }
        if self.padded.capacity() > KEEP_BYTES {
            self.padded = Vec::new();
        }
        (at as u64, GsoEnd::Done)
    }
}

/// The sender thread: every [`NAP`], the whole queue out; until the configuration is gone
/// (capture turned off or reconfigured, or the process ends) and its queue sent.
fn send_loop(c: &HepCapture, shared: &Arc<Shared>, stats: &CaptureStats) {
    let mut link = Link::new(c);
    let mut batch = Vec::new();
    let mut logged_drops = stats.dropped_total();
    let mut last_log = Instant::now();
    loop {
        let (open, connected) = link.tend(c, Instant::now());
        shared.gate.set(shared.generation, open);
        shared.connected.store(connected, Ordering::Relaxed);
        // The configuration is gone once this thread holds the last reference: one more
        // take of the queue catches the taps that were still writing.
        let last = Arc::strong_count(shared) == 1;
        std::mem::swap(&mut *shared.queue(), &mut batch);
        if !batch.is_empty() {
            let done = link.send(c, &batch);
            stats.sent.fetch_add(done.sent, Ordering::Relaxed);
            stats
                .dropped_send_error
                .fetch_add(done.failed, Ordering::Relaxed);
            if batch.capacity() > KEEP_BYTES && batch.len() <= KEEP_BYTES / 4 {
                batch = Vec::new();
            }
            batch.clear();
        }
        if last {
            break;
        }
        log_drops(c, stats, &mut logged_drops, &mut last_log);
        // A data path never wakes this thread (a wake-up per message, a futex call and a
        // context switch, would cost more than the capture itself): the queue holds what
        // arrives meanwhile, and goes out as one batch.
        std::thread::sleep(if open { NAP } else { NAP_DOWN });
    }
}

/// The Call-ID of a SIP message (its value, trimmed), found without parsing the rest: the
/// first header line named `Call-ID` or its compact form `i` (RFC 3261 §7.3.3, §20.8) before
/// the blank line that ends the headers, with the lines that continue it (§7.3.1), as the
/// scanner reads it ([`crate::sip::SipMsg::call_id`]). PURE.
pub fn call_id_of(msg: &[u8]) -> Option<&[u8]> {
    // Lines by memchr; only one that opens with `c` or `i` is looked at any closer.
    let mut start = memchr::memchr(b'\n', msg)? + 1; // past the start line
    loop {
        let end = memchr::memchr(b'\n', &msg[start..]).map_or(msg.len(), |i| start + i);
        let line = &msg[start..end];
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            return None;
        }
        if matches!(line[0], b'c' | b'C' | b'i' | b'I')
            && let Some(colon) = memchr::memchr(b':', line)
        {
            let name = line[..colon].trim_ascii();
            if name.eq_ignore_ascii_case(b"call-id") || name.eq_ignore_ascii_case(b"i") {
                // A line that opens with a space or tab continues this one.
                let mut end = end;
                while let Some(b' ' | b'\t') = msg.get(end + 1) {
                    end = memchr::memchr(b'\n', &msg[end + 1..]).map_or(msg.len(), |i| end + 1 + i);
                }
                let value = msg[start + colon + 1..end].trim_ascii();
                return (!value.is_empty()).then_some(value);
            }
        }
        if end >= msg.len() {
            return None;
        }
        start = end + 1;
    }
}
/// Log the drops since the last log, at most once every [`LOG_EVERY`].
fn log_drops(c: &HepCapture, stats: &CaptureStats, logged: &mut u64, last: &mut Instant) {
    if last.elapsed() < LOG_EVERY {
        return;
    }
    let total = stats.dropped_total();
    if total > *logged {
        tracing::warn!(dropped = total - *logged, collector = %c.address, "capture packets dropped (queue full, too big or collector unreachable)");
        *logged = total;
    }
    *last = Instant::now();
}

/// One vserver's view of [`Capture`]: what its data path calls per message.
#[derive(Debug, Clone)]
pub struct Tap {
    capture: Arc<Capture>,
    vserver: Arc<str>,
}

impl Tap {
    pub fn new(capture: &Arc<Capture>, vserver: &str) -> Tap {
        Tap {
            capture: Arc::clone(capture),
            vserver: Arc::from(vserver),
        }
    }

    /// The time of a receive or send about to be captured; `None` (no clock read) while
    /// capture is off, and no clock read either while the collector is known to be down
    /// (the tap then counts the message dropped).
    #[inline]
    pub fn stamp(&self) -> Option<Stamp> {
        if !self.capture.is_on() {
            return None;
        }
        Some(if self.capture.gate.is_open() {
            Stamp::now()
        } else {
            Stamp::DOWN
        })
    }

    /// [`Capture::tap`] for this vserver.
    #[inline]
    pub fn tap(
        &self,
        at: Stamp,
        transport: Transport,
        src: SocketAddr,
        dst: SocketAddr,
        payload: &[u8],
    ) {
        self.capture
            .tap(&self.vserver, at, transport, src, dst, payload);
    }

    /// [`Capture::tap_as`] for this vserver.
    #[inline]
    pub fn tap_as(
        &self,
        at: Stamp,
        leg: (Transport, SocketAddr, SocketAddr),
        payload: &[u8],
        call_id: CallId<'_>,
    ) {
        self.capture
            .tap_as(&self.vserver, at, leg, payload, call_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read as _;
    use std::net::TcpListener;

    const INVITE: &[u8] =
        b"INVITE sip:bob@example.com SIP/2.0\r\nCall-ID: c7@host\r\nContent-Length: 0\r\n\r\n";

    fn config(address: SocketAddr, transport: CaptureTransport) -> HepCapture {
        HepCapture {
            address,
            transport,
            id: 2001,
            password: Some("s3".into()),
            vservers: None,
            probes: false,
            udp_gso: false,
        }
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("address")
    }

    /// Poll `cond` every 10 ms for at most 5 s.
    fn eventually(mut cond: impl FnMut() -> bool) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if cond() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        cond()
    }

    /// A TCP collector's listener (nothing accepted yet) and a capture sending to it.
    fn tcp_collector() -> (TcpListener, Capture) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let c = Capture::new(Some(&config(
            listener.local_addr().expect("addr"),
            CaptureTransport::Tcp,
        )));
        (listener, c)
    }

    fn collector_udp() -> UdpSocket {
        let s = UdpSocket::bind("127.0.0.1:0").expect("bind");
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        s
    }

    fn recv_hep(s: &UdpSocket) -> hep::Decoded {
        let mut buf = vec![0u8; 70_000];
        let n = s.recv(&mut buf).expect("a HEP packet");
        hep::decode(&buf[..n]).expect("decodes")
    }

    /// Read one HEP packet from a stream: its total length is in bytes 4..6.
    fn read_hep(s: &mut std::net::TcpStream) -> std::io::Result<hep::Decoded> {
        let mut head = [0u8; 6];
        s.read_exact(&mut head)?;
        let len = u16::from_be_bytes([head[4], head[5]]) as usize;
        let mut rest = vec![0u8; len.saturating_sub(6)];
        s.read_exact(&mut rest)?;
        let whole = [&head[..], &rest].concat();
        hep::decode(&whole).map_err(|e| std::io::Error::other(e.to_string()))
    }

    #[test]
    fn the_call_id_is_found_in_full_or_compact_form_and_only_among_the_headers() {
        assert_eq!(call_id_of(INVITE), Some(&b"c7@host"[..]));
        let compact = b"SIP/2.0 200 OK\r\nv: SIP/2.0/UDP h;branch=z9hG4bK1\r\ni:  a@b \r\n\r\n";
        assert_eq!(call_id_of(compact), Some(&b"a@b"[..]));
        let lf_only = b"BYE sip:x SIP/2.0\nCALL-ID:q@r\n\n";
        assert_eq!(call_id_of(lf_only), Some(&b"q@r"[..]));
        // Folded (RFC 3261 §7.3.1): the value on the next line, or over two.
        let folded = b"BYE sip:x SIP/2.0\r\nCall-ID:\r\n  f@h\r\nCSeq: 1 BYE\r\n\r\n";
        assert_eq!(call_id_of(folded), Some(&b"f@h"[..]));
        let split = b"BYE sip:x SIP/2.0\r\ni: a\r\n\tb\r\n\r\n";
        assert_eq!(call_id_of(split), Some(&b"a\r\n\tb"[..]));
        // A continuation of another header is not a Call-ID.
        let inner = b"BYE sip:x SIP/2.0\r\nSubject: x\r\n Call-ID: no\r\n\r\n";
        assert_eq!(call_id_of(inner), None);
        let in_body = b"MESSAGE sip:x SIP/2.0\r\nContent-Length: 12\r\n\r\nCall-ID: no\r\n";
        assert_eq!(call_id_of(in_body), None);
        assert_eq!(
            call_id_of(b"INVITE sip:x SIP/2.0\r\nCall-ID: \r\n\r\n"),
            None
        );
        assert_eq!(call_id_of(b""), None);
    }

    proptest::proptest! {
        /// Whatever the bytes, the Call-ID found agrees with the scanner's when the scanner
        /// reads the message.
        #[test]
        fn the_call_id_agrees_with_the_scanner(
            cid in "[a-zA-Z0-9@.-]{1,30}",
            compact in proptest::bool::ANY,
            folded in proptest::bool::ANY,
            before in proptest::collection::vec("[A-Z][a-z]{1,8}: [a-z0-9]{1,10}", 0..4),
        ) {
            let mut m = String::from("OPTIONS sip:a@b SIP/2.0\r\nVia: SIP/2.0/UDP h;branch=z9hG4bK1\r\n");
            for h in &before {
                m.push_str(h);
                m.push_str("\r\n");
            }
            m.push_str(if compact { "i: " } else { "Call-ID: " });
            if folded {
                m.push_str("\r\n\t ");
            }
            m.push_str(&cid);
            m.push_str("\r\nCSeq: 1 OPTIONS\r\nContent-Length: 0\r\n\r\n");
            let scanned = crate::sip::scan(m.as_bytes()).ok().and_then(|s| s.call_id());
            proptest::prop_assert_eq!(call_id_of(m.as_bytes()), scanned);
        }
    }

    #[test]
    fn a_udp_collector_gets_each_message_with_its_leg_and_call_id() {
        let collector = collector_udp();
        let c = Capture::new(Some(&config(
            collector.local_addr().expect("addr"),
            CaptureTransport::Udp,
        )));
        c.tap(
            "edge",
            Stamp(Some(Duration::new(1_764_900_000, 123_456_789))),
            Transport::Udp,
            addr("127.0.0.1:40000"),
            addr("127.0.0.1:5060"),
            INVITE,
        );
        let d = recv_hep(&collector);
        assert_eq!((d.family, d.ip_proto), (Some(2), Some(17)));
        assert_eq!(d.src, Some(addr("127.0.0.1:40000").ip()));
        assert_eq!((d.src_port, d.dst_port), (Some(40000), Some(5060)));
        assert_eq!((d.agent_id, d.proto_type), (Some(2001), Some(1)));
        assert_eq!(d.auth_key.as_deref(), Some(&b"s3"[..]));
        assert_eq!(d.payload.as_deref(), Some(INVITE));
        assert_eq!(d.correlation_id.as_deref(), Some(&b"c7@host"[..]));
        assert_eq!((d.time_s, d.time_us), (Some(1_764_900_000), Some(123_456)));
        assert!(eventually(|| c.stats().sent.load(Ordering::Relaxed) == 1));
        assert!(c.is_connected());
    }

    /// With `udp_gso`, packets of different sizes go out padded in GSO sends: each datagram
    /// is one packet, in order, that reads as it was written.
    #[test]
    fn udp_gso_sends_each_packet_as_its_own_padded_datagram() {
        let collector = collector_udp();
        let mut cfg = config(collector.local_addr().expect("addr"), CaptureTransport::Udp);
        cfg.udp_gso = true;
        let c = Capture::new(Some(&cfg));
        let (a, b) = (addr("127.0.0.1:1"), addr("127.0.0.1:2"));
        let msgs: Vec<Vec<u8>> = (0..40)
            .map(|i| {
                let body = "x".repeat(i * 37 % 700);
                format!(
                    "MESSAGE sip:a SIP/2.0\r\nCall-ID: m{i}\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                )
                .into_bytes()
            })
            .collect();
        for m in &msgs {
            c.tap("edge", Stamp::now(), Transport::Udp, a, b, m);
        }
        for (i, m) in msgs.iter().enumerate() {
            let d = recv_hep(&collector);
            assert_eq!(d.payload.as_deref(), Some(&m[..]), "packet {i}");
            assert_eq!(d.correlation_id, Some(format!("m{i}").into_bytes()));
        }
        assert!(eventually(|| c.stats().sent.load(Ordering::Relaxed) == 40));
    }

    #[test]
    fn only_the_listed_vservers_and_probes_when_asked_are_captured() {
        let collector = collector_udp();
        let mut cfg = config(collector.local_addr().expect("addr"), CaptureTransport::Udp);
        cfg.vservers = Some(vec!["edge".into()]);
        let c = Capture::new(Some(&cfg));
        let (a, b) = (addr("127.0.0.1:1"), addr("127.0.0.1:2"));
        c.tap("other", Stamp::now(), Transport::Udp, a, b, b"not this one");
        c.tap_probe(Stamp::now(), Transport::Udp, a, b, b"nor this probe");
        c.tap("edge", Stamp::now(), Transport::Tcp, a, b, INVITE);
        let d = recv_hep(&collector);
        assert_eq!((d.payload.as_deref(), d.ip_proto), (Some(INVITE), Some(6)));
        cfg.probes = true;
        c.configure(Some(&cfg));
        c.tap_probe(Stamp::now(), Transport::Udp, a, b, b"OPTIONS probe");
        let d = recv_hep(&collector);
        assert_eq!(d.payload.as_deref(), Some(&b"OPTIONS probe"[..]));
    }

    #[test]
    fn a_message_too_big_for_one_packet_is_counted_and_skipped() {
        let collector = collector_udp();
        let c = Capture::new(Some(&config(
            collector.local_addr().expect("addr"),
            CaptureTransport::Udp,
        )));
        let (a, b) = (addr("127.0.0.1:1"), addr("127.0.0.1:2"));
        c.tap(
            "edge",
            Stamp::now(),
            Transport::Tcp,
            a,
            b,
            &vec![b'x'; hep::MAX_PACKET],
        );
        c.tap("edge", Stamp::now(), Transport::Udp, a, b, INVITE);
        assert_eq!(recv_hep(&collector).payload.as_deref(), Some(INVITE));
        assert_eq!(c.stats().dropped_too_big.load(Ordering::Relaxed), 1);
        assert!(eventually(|| c.stats().sent.load(Ordering::Relaxed) == 1));
    }

    #[test]
    fn reload_turns_capture_off_and_on() {
        let collector = collector_udp();
        let cfg = config(collector.local_addr().expect("addr"), CaptureTransport::Udp);
        let c = Capture::new(None);
        let (a, b) = (addr("127.0.0.1:1"), addr("127.0.0.1:2"));
        assert!(!c.is_on());
        c.tap("edge", Stamp::now(), Transport::Udp, a, b, b"while off");
        c.configure(Some(&cfg));
        assert_eq!(c.config(), Some(cfg.clone()));
        c.tap("edge", Stamp::now(), Transport::Udp, a, b, INVITE);
        assert_eq!(recv_hep(&collector).payload.as_deref(), Some(INVITE));
        c.configure(None);
        assert!(!c.is_on() && !c.is_connected());
        c.tap("edge", Stamp::now(), Transport::Udp, a, b, b"off again");
        collector
            .set_read_timeout(Some(Duration::from_millis(300)))
            .expect("timeout");
        let mut buf = [0u8; 2048];
        assert!(collector.recv(&mut buf).is_err(), "nothing while off");
        assert_eq!(c.stats().sent.load(Ordering::Relaxed), 1);
    }

    /// Nothing listens: every message is accounted for as sent or dropped, and the taps never
    /// wait for the collector.
    #[test]
    fn a_dead_udp_collector_costs_capture_packets_only() {
        let port = collector_udp().local_addr().expect("addr"); // closed once dropped
        let c = Capture::new(Some(&config(port, CaptureTransport::Udp)));
        let (a, b) = (addr("127.0.0.1:1"), addr("127.0.0.1:2"));
        let n = 20_000u64;
        for _ in 0..n {
            c.tap("edge", Stamp::now(), Transport::Udp, a, b, INVITE);
        }
        let s = c.stats();
        assert!(eventually(|| {
            s.sent.load(Ordering::Relaxed) + s.dropped().iter().map(|d| d.1).sum::<u64>() == n
        }));
        assert!(s.dropped_send_error.load(Ordering::Relaxed) > 0);
        assert!(eventually(|| !c.is_connected()));
    }

    #[test]
    fn a_tcp_collector_is_reconnected_after_it_closes() {
        let (listener, c) = tcp_collector();
        let (a, b) = (addr("127.0.0.1:1"), addr("127.0.0.1:2"));
        c.tap("edge", Stamp::now(), Transport::Tcp, a, b, INVITE);
        let (mut first, _) = listener.accept().expect("first connection");
        first
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let d = read_hep(&mut first).expect("first packet");
        assert_eq!(d.payload.as_deref(), Some(INVITE));
        assert!(c.is_connected());
        drop(first);
        // Taps go on until a packet fails on the closed connection and a new one is opened
        // (after at least the shortest backoff).
        listener.set_nonblocking(true).expect("nonblocking");
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut second = None;
        while second.is_none() && Instant::now() < deadline {
            c.tap("edge", Stamp::now(), Transport::Tcp, a, b, INVITE);
            std::thread::sleep(Duration::from_millis(20));
            second = listener.accept().ok().map(|(s, _)| s);
        }
        let mut second = second.expect("a second connection");
        second.set_nonblocking(false).expect("blocking");
        second
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        c.tap("edge", Stamp::now(), Transport::Tcp, a, b, INVITE);
        let d = read_hep(&mut second).expect("a packet on the new connection");
        assert_eq!(d.correlation_id.as_deref(), Some(&b"c7@host"[..]));
        assert!(c.stats().dropped_send_error.load(Ordering::Relaxed) > 0);
    }

    #[test]
    fn a_closed_window_is_bytes_waiting_with_none_in_flight() {
        assert!(!peer_window_closed(0, 0), "an empty queue");
        assert!(!peer_window_closed(4_000, 0), "in flight, none waiting");
        assert!(
            !peer_window_closed(9_000, 5_000),
            "in flight and waiting: the window is open"
        );
        assert!(peer_window_closed(5_000, 5_000), "waiting, none in flight");
    }

    /// A collector that stops reading (its window closes) costs the taps a drop at once while
    /// the connection stays, and the packets flow again on it once the collector reads: the
    /// stream stays in step, packet after whole packet.
    #[test]
    fn a_tcp_collector_that_stops_reading_is_dropped_for_until_it_reads_again() {
        let (listener, c) = tcp_collector();
        let (a, b) = (addr("127.0.0.1:1"), addr("127.0.0.1:2"));
        c.tap("edge", Stamp::now(), Transport::Tcp, a, b, INVITE);
        let (mut held, _) = listener.accept().expect("connection");
        let s = c.stats();
        // 1 KB messages at about 10 MB/s (bounded: 20,000 taps, 2 s) until the taps drop.
        let msg = [INVITE, &[b'x'; 1_000][..]].concat();
        let mut offered = 1u64;
        for _ in 0..20_000 {
            c.tap("edge", Stamp::now(), Transport::Tcp, a, b, &msg);
            offered += 1;
            if s.dropped_send_error.load(Ordering::Relaxed) > 0 {
                break;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        assert!(
            s.dropped_send_error.load(Ordering::Relaxed) > 0,
            "never closed"
        );
        // Closed by the window, not by a full queue or a blocked write: still connected.
        assert_eq!(s.dropped_queue_full.load(Ordering::Relaxed), 0);
        assert!(c.is_connected());
        // Stopped early: what was offered is about the two buffers between, not 8 MB more.
        assert!(offered < 8_000, "{offered} taps before the window closed");
        // The collector reads: every packet sent arrives whole, and new ones follow.
        held.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut got = 0u64;
        while got < s.sent.load(Ordering::Relaxed) {
            read_hep(&mut held).expect("a packet sent before the stall");
            got += 1;
        }
        assert!(eventually(|| {
            c.tap("edge", Stamp::now(), Transport::Tcp, a, b, INVITE);
            s.sent.load(Ordering::Relaxed) > got
        }));
        let late = loop {
            let d = read_hep(&mut held).expect("a packet after the stall");
            if d.payload.as_deref() == Some(INVITE) {
                break d;
            }
        };
        assert_eq!(late.correlation_id.as_deref(), Some(&b"c7@host"[..]));
    }

    /// A collector that accepts and never reads: the queue fills and drops, the taps return at
    /// once, and the sender gives the connection up after its write timeout.
    #[test]
    fn a_tcp_collector_that_stops_reading_never_stalls_the_taps() {
        let (listener, c) = tcp_collector();
        let (a, b) = (addr("127.0.0.1:1"), addr("127.0.0.1:2"));
        c.tap("edge", Stamp::now(), Transport::Tcp, a, b, INVITE);
        let (_held, _) = listener.accept().expect("connection");
        let big = vec![b'x'; 60_000];
        let started = Instant::now();
        for _ in 0..2_000 {
            c.tap("edge", Stamp::now(), Transport::Tcp, a, b, &big);
        }
        // 120 MB offered: far past the queue's bytes and the socket buffers.
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        assert!(c.stats().dropped_queue_full.load(Ordering::Relaxed) > 0);
        assert!(eventually(|| !c.is_connected()));
    }
}
