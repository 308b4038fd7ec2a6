//! A strict SIP UAS for the tests, over UDP or TCP: it answers like a production callee and
//! refuses what a production callee refuses, so a request fulcrum sends to the wrong service
//! fails loudly instead of being answered 200 by a lenient peer.
//!
//! - INVITE outside a dialog: 100, 180 and 200, the 18x / 200 with a To tag of its own, a
//!   Contact, and the request's Record-Route values echoed (RFC 3261 §12.1.1); the dialog
//!   (Call-ID, its tag, the caller's tag; §12) is set up.
//! - ACK: never answered (§17.1.1.3); one for no dialog of this UAS is counted as stray.
//! - BYE and any other request with a To tag: 200 only within a dialog this UAS set up,
//!   otherwise **481 Call/Transaction Does Not Exist** (§12.2.2, §15.1.2).
//! - CANCEL (§9.2): of an INVITE still pending here (not answered finally), 200 to the
//!   CANCEL and 487 Request Terminated to the INVITE, whose ACK is then expected; of an
//!   INVITE already answered 200, 200 (the CANCEL has no effect); of no INVITE transaction
//!   this UAS got (Call-ID and branch), 481, counted as stray.
//! - OPTIONS and other requests outside a dialog: 200.
//! - Sick on demand ([`Sick`]), as services fail in real farms while their keep-alive may
//!   still look fine: INVITEs answered 503 with Retry-After (OPTIONS too, or not), or never
//!   answered at all, or answered 180 and then nothing until cancelled, or answered 200 only
//!   after a delay (a UAS stuck for a while), or answered 486 Busy Here (a busy callee), or
//!   every new request answered 503 (an overloaded server), or an INVITE without credentials
//!   challenged with 407 (a proxy that authenticates its callers); the ACK of its 486, 503 or
//!   407 is expected, not stray.
//!
//! Retransmission-safe: the To tag is derived from the UAS name, Call-ID and From tag, so a
//! retransmitted INVITE gets the same answers (and sets up nothing new); an ended dialog is
//! remembered, so a BYE retransmitted after its 200 gets 200 again.
//!
//! Why Rust and not a SIPp scenario: SIPp's UAS starts a scenario instance per new Call-ID,
//! and a BYE for an unknown Call-ID can only reach an out-of-call scenario (`-oocsf`), which
//! matches on Call-ID alone (not on the tags of RFC 3261 §12) and whose counts would have to
//! be scraped from SIPp's screen dumps after the process ends. Here the dialog match is
//! exact, the counters are read live in the test, and the UAS is bound before `start`
//! returns (no readiness polling).
//!
//! The decision core ([`UasCore`]) is PURE: bytes in, responses out. [`StrictUas`] is the IO
//! shell: one thread per UDP socket, or an accept thread plus one thread per TCP connection
//! (Content-Length framing, responses on the connection the request came on; fulcrum keeps
//! one long-lived connection per service).
//!
//! The same code runs as a standalone process in `examples/strict_uas.rs` (for
//! `bench/churn.sh`), which includes this file by path.

use super::sip_tcp::{Next, TimedRead, next_message};
use fulcrum::sip::{self, HeaderName, SipMethod, SipMsg};
use std::collections::HashMap;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::io::Write;
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What one UAS has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Requests received (retransmissions included).
    pub requests: u64,
    /// Dialogs set up (first INVITE of each; retransmissions not counted).
    pub dialogs: u64,
    /// Dialogs ended by a BYE answered 200 (a retransmitted BYE is not counted again).
    pub byes_ok: u64,
    /// 481 Call/Transaction Does Not Exist sent.
    pub r481: u64,
    /// ACKs for no dialog of this UAS.
    pub stray_acks: u64,
    /// INVITE transactions received outside a dialog (retransmissions not counted).
    pub invites: u64,
    /// Dialogs whose 2xx was acknowledged (the first ACK of each).
    pub acked: u64,
    /// CANCELs of an INVITE pending here: answered 200, and the INVITE 487.
    pub cancels: u64,
    /// CANCELs of no INVITE transaction this UAS got (answered 481, counted in `r481` too).
    pub stray_cancels: u64,
    /// INVITEs without credentials challenged with 407 ([`Sick::Challenging`]; a
    /// retransmission is not counted again).
    pub challenges: u64,
}

/// How a UAS is sick.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Sick {
    #[default]
    Healthy,
    /// INVITE answered 503 + Retry-After; OPTIONS still 200 (an overloaded proxy whose
    /// keep-alive passes).
    Busy,
    /// INVITE and OPTIONS answered 503 + Retry-After.
    Down,
    /// INVITE never answered (a stuck call thread); OPTIONS still 200.
    Silent,
    /// INVITE answered 100 and 180, then nothing until a CANCEL (a phone that rings and is
    /// never picked up); OPTIONS still 200.
    Ringing,
    /// INVITE answered 200 only after this many milliseconds, nothing before (a UAS stuck for
    /// a while, then answering); the dialog is set up when the INVITE arrives.
    Late(u32),
    /// INVITE answered 486 Busy Here (a callee on another call: a final answer that is not a
    /// failover code, relayed to the caller); OPTIONS still 200.
    Refusing,
    /// Every request outside a dialog (INVITE, REGISTER, MESSAGE, OPTIONS...) answered 503 +
    /// Retry-After: an overloaded server refusing all new work.
    Overloaded,
    /// An INVITE without Proxy-Authorization answered 407 Proxy Authentication Required with a
    /// Proxy-Authenticate challenge (RFC 3261 §22.3), one with it answered as a healthy UAS
    /// answers (the credentials are not checked): a proxy that authenticates its callers.
    Challenging,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dialog {
    Confirmed,
    Ended,
}

/// An INVITE transaction (Call-ID, top Via branch): what a CANCEL matches (§9.2).
type InviteTx = (Vec<u8>, Vec<u8>);

/// Dialog identifier at the UAS (RFC 3261 §12): Call-ID, local tag, remote tag.
type DialogId = (Vec<u8>, Vec<u8>, Vec<u8>);

/// The decision core: one request in, the responses to send back out. PURE.
#[derive(Debug)]
pub struct UasCore {
    name: String,
    contact: String,
    dialogs: HashMap<DialogId, Dialog>,
    /// Call-ID → methods received, in order.
    calls: HashMap<String, Vec<String>>,
    counts: Counts,
    /// The top Via of the last request (what the hop before this UAS said of itself).
    last_via: Option<String>,
    /// The top Via of the last request other than OPTIONS (a call's, not a monitor's).
    last_call_via: Option<String>,
    sick: Sick,
    /// INVITE transactions seen outside a dialog.
    invite_txs: std::collections::HashSet<InviteTx>,
    /// INVITE transactions not answered finally (Silent, Ringing): the request, for its 487.
    pending: HashMap<InviteTx, Vec<u8>>,
    /// Dialogs whose 2xx was acknowledged.
    acked: std::collections::HashSet<DialogId>,
    /// Answers due later, with their delay from the request (Late): the shell sends them.
    later: Vec<(Duration, Vec<u8>)>,
    /// Call-IDs this UAS refused with 486, 503 or 487 (their ACK is expected).
    refused: std::collections::HashSet<Vec<u8>>,
    /// INVITEs (Call-ID, CSeq number) this UAS challenged with 407 (their ACK is expected).
    challenged: std::collections::HashSet<(Vec<u8>, u32)>,
}

impl UasCore {
    /// A UAS called `name` whose Contact is `sip:name@at;transport=transport`.
    pub fn new(name: &str, at: SocketAddr, transport: &str) -> UasCore {
        UasCore {
            name: name.to_owned(),
            contact: format!("<sip:{name}@{at};transport={transport}>"),
            dialogs: HashMap::new(),
            calls: HashMap::new(),
            counts: Counts::default(),
            last_via: None,
            last_call_via: None,
            sick: Sick::Healthy,
            invite_txs: Default::default(),
            pending: HashMap::new(),
            acked: Default::default(),
            later: Vec::new(),
            refused: Default::default(),
            challenged: Default::default(),
        }
    }

    /// Turn this UAS sick (or healthy again).
    pub fn set_sick(&mut self, sick: Sick) {
        self.sick = sick;
    }

    pub fn counts(&self) -> Counts {
        self.counts
    }

    /// The methods received for one Call-ID, in order.
    pub fn methods_of(&self, call_id: &str) -> Vec<String> {
        self.calls.get(call_id).cloned().unwrap_or_default()
    }

    /// The answers due later ([`Sick::Late`]), each with its delay from the request that
    /// asked for it: the shell sends them when due.
    pub fn take_later(&mut self) -> Vec<(Duration, Vec<u8>)> {
        std::mem::take(&mut self.later)
    }

    /// The top Via value of the last request received.
    pub fn last_via(&self) -> Option<String> {
        self.last_via.clone()
    }

    /// The top Via value of the last request other than OPTIONS.
    pub fn last_call_via(&self) -> Option<String> {
        self.last_call_via.clone()
    }

    /// The tag this UAS gives the dialog of (Call-ID, From tag): stable across
    /// retransmissions, different per UAS.
    fn local_tag(&self, call_id: &[u8], from_tag: &[u8]) -> String {
        let mut h = DefaultHasher::new();
        (call_id, from_tag).hash(&mut h);
        format!("{}-{:016x}", self.name, h.finish())
    }

    /// Handle one message; responses are ignored (this UAS sends no requests).
    pub fn handle(&mut self, bytes: &[u8]) -> Vec<Vec<u8>> {
        let Ok(msg) = sip::scan(bytes) else {
            return Vec::new();
        };
        if !msg.is_request() {
            return Vec::new();
        }
        self.counts.requests += 1;
        self.last_via = msg
            .via_header()
            .map(|v| String::from_utf8_lossy(v).into_owned());
        let method = String::from_utf8_lossy(msg.method().unwrap_or(b"?")).into_owned();
        if method != "OPTIONS" {
            self.last_call_via.clone_from(&self.last_via);
        }
        let (Some(call_id), Some(from_tag), Some(_), Some(_)) =
            (msg.call_id(), msg.from_tag(), msg.cseq(), msg.top_via())
        else {
            return match msg.method_kind() {
                SipMethod::Ack => Vec::new(),
                _ => vec![respond(&msg, 400, "Bad Request", None, None, false)],
            };
        };
        self.calls
            .entry(String::from_utf8_lossy(call_id).into_owned())
            .or_default()
            .push(method);
        let tag = self.local_tag(call_id, from_tag);
        let id: DialogId = (
            call_id.to_vec(),
            tag.clone().into_bytes(),
            from_tag.to_vec(),
        );
        let state = match msg.to_tag() {
            Some(t) if t == tag.as_bytes() => self.dialogs.get(&id).copied(),
            _ => None,
        };
        let contact = Some(self.contact.as_str());
        let branch = msg.top_via().and_then(|v| v.branch).unwrap_or_default();
        let tx: InviteTx = (call_id.to_vec(), branch.to_vec());
        let mut first = false;
        if msg.method_kind() == SipMethod::Invite && msg.to_tag().is_none() {
            first = self.invite_txs.insert(tx.clone());
            if first {
                self.counts.invites += 1;
            }
        }
        let unavailable = || {
            let mut r = respond(&msg, 503, "Service Unavailable", Some(&tag), None, false);
            let at = r.len() - 2;
            r.splice(at..at, b"Retry-After: 30\r\n".iter().copied());
            vec![r]
        };
        match (self.sick, msg.method_kind(), msg.to_tag()) {
            (Sick::Busy | Sick::Down, SipMethod::Invite, None) => {
                self.refused.insert(call_id.to_vec());
                return unavailable();
            }
            (Sick::Down, SipMethod::Options, None) => return unavailable(),
            (Sick::Refusing, SipMethod::Invite, None) => {
                self.refused.insert(call_id.to_vec());
                return vec![respond(&msg, 486, "Busy Here", Some(&tag), None, false)];
            }
            (Sick::Challenging, SipMethod::Invite, None) if !has_credentials(&msg) => {
                let seq = msg.cseq().map_or(0, |c| c.seq);
                if self.challenged.insert((call_id.to_vec(), seq)) {
                    self.counts.challenges += 1;
                }
                let reason = "Proxy Authentication Required";
                let mut r = respond(&msg, 407, reason, Some(&tag), None, false);
                let at = r.len() - 2;
                let challenge = format!(
                    "Proxy-Authenticate: Digest realm=\"{}\", nonce=\"{:016x}\", algorithm=MD5, qop=\"auth\"\r\n",
                    self.name,
                    {
                        let mut h = DefaultHasher::new();
                        (call_id, seq).hash(&mut h);
                        h.finish()
                    }
                );
                r.splice(at..at, challenge.into_bytes());
                return vec![r];
            }
            (Sick::Overloaded, m, None) if m != SipMethod::Ack && m != SipMethod::Cancel => {
                self.refused.insert(call_id.to_vec());
                return unavailable();
            }
            (Sick::Silent, SipMethod::Invite, None) => {
                self.pending.entry(tx).or_insert_with(|| bytes.to_vec());
                return Vec::new();
            }
            (Sick::Ringing, SipMethod::Invite, None) => {
                if !first && !self.pending.contains_key(&tx) {
                    // A retransmission of an INVITE already cancelled: its 487 went.
                    return Vec::new();
                }
                self.pending.entry(tx).or_insert_with(|| bytes.to_vec());
                return vec![
                    respond(&msg, 100, "Trying", None, None, false),
                    respond(&msg, 180, "Ringing", Some(&tag), contact, true),
                ];
            }
            (Sick::Late(ms), SipMethod::Invite, None) => {
                if first {
                    self.dialogs.insert(id, Dialog::Confirmed);
                    self.counts.dialogs += 1;
                    let ok = respond(&msg, 200, "OK", Some(&tag), contact, true);
                    self.later.push((Duration::from_millis(u64::from(ms)), ok));
                }
                return Vec::new();
            }
            _ => {}
        }
        match (msg.method_kind(), msg.to_tag()) {
            (SipMethod::Ack, _) if self.refused.contains(call_id) => Vec::new(),
            (SipMethod::Ack, _)
                if self
                    .challenged
                    .contains(&(call_id.to_vec(), msg.cseq().map_or(0, |c| c.seq))) =>
            {
                Vec::new()
            }
            (SipMethod::Ack, _) => match state {
                None => {
                    self.counts.stray_acks += 1;
                    Vec::new()
                }
                Some(_) => {
                    if self.acked.insert(id) {
                        self.counts.acked += 1;
                    }
                    Vec::new()
                }
            },
            (SipMethod::Invite, None) => {
                if let std::collections::hash_map::Entry::Vacant(e) = self.dialogs.entry(id) {
                    e.insert(Dialog::Confirmed);
                    self.counts.dialogs += 1;
                }
                vec![
                    respond(&msg, 100, "Trying", None, None, false),
                    respond(&msg, 180, "Ringing", Some(&tag), contact, true),
                    respond(&msg, 200, "OK", Some(&tag), contact, true),
                ]
            }
            (SipMethod::Cancel, _) => {
                if let Some(invite) = self.pending.remove(&tx) {
                    // §9.2: the CANCEL answered 200, the INVITE it cancels 487.
                    self.counts.cancels += 1;
                    self.refused.insert(call_id.to_vec());
                    let mut out = vec![respond(&msg, 200, "OK", Some(&tag), None, false)];
                    if let Ok(invite) = sip::scan(&invite) {
                        let r = "Request Terminated";
                        out.push(respond(&invite, 487, r, Some(&tag), None, false));
                    }
                    out
                } else if self.dialogs.contains_key(&id) {
                    vec![respond(&msg, 200, "OK", Some(&tag), None, false)]
                } else {
                    self.counts.stray_cancels += 1;
                    self.not_found(&msg)
                }
            }
            (SipMethod::Bye, _) => match state {
                Some(s) => {
                    if s == Dialog::Confirmed {
                        self.counts.byes_ok += 1;
                        self.dialogs.insert(id, Dialog::Ended);
                    }
                    vec![respond(&msg, 200, "OK", None, None, false)]
                }
                None => self.not_found(&msg),
            },
            (_, Some(_)) => match state {
                Some(Dialog::Confirmed) => vec![respond(&msg, 200, "OK", None, contact, false)],
                _ => self.not_found(&msg),
            },
            (_, None) => vec![respond(&msg, 200, "OK", Some(&tag), None, false)],
        }
    }

    fn not_found(&mut self, msg: &SipMsg<'_>) -> Vec<Vec<u8>> {
        self.counts.r481 += 1;
        vec![respond(
            msg,
            481,
            "Call/Transaction Does Not Exist",
            None,
            None,
            false,
        )]
    }
}

/// Whether `msg` carries credentials for a proxy (a Proxy-Authorization header, RFC 3261
/// §22.3).
fn has_credentials(msg: &SipMsg<'_>) -> bool {
    msg.headers()
        .any(|h| h.name.eq_ignore_ascii_case(b"Proxy-Authorization"))
}

/// A response to `msg` (RFC 3261 §8.2.6.2): its Via values in order, From, To (with `tag`
/// added when the request had none), Call-ID, CSeq; Record-Route echoed when `echo_rr`
/// (§12.1.1), Contact when given, no body.
fn respond(
    msg: &SipMsg<'_>,
    code: u16,
    reason: &str,
    tag: Option<&str>,
    contact: Option<&str>,
    echo_rr: bool,
) -> Vec<u8> {
    let mut out = format!("SIP/2.0 {code} {reason}\r\n").into_bytes();
    let mut put = |name: &str, value: &[u8]| {
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    };
    for h in msg.headers() {
        match HeaderName::classify(h.name) {
            HeaderName::Via => put("Via", h.value),
            HeaderName::RecordRoute if echo_rr => put("Record-Route", h.value),
            _ => {}
        }
    }
    put("From", msg.from_header().unwrap_or_default());
    let mut to = msg.to_header().unwrap_or_default().to_vec();
    if let (Some(t), None) = (tag, msg.to_tag()) {
        to.extend_from_slice(format!(";tag={t}").as_bytes());
    }
    put("To", &to);
    put("Call-ID", msg.call_id().unwrap_or_default());
    put("CSeq", msg.cseq_raw().unwrap_or_default());
    if let Some(c) = contact {
        put("Contact", c.as_bytes());
    }
    out.extend_from_slice(b"Content-Length: 0\r\n\r\n");
    out
}

/// A running strict UAS (stops when dropped).
pub struct StrictUas {
    pub name: String,
    pub addr: SocketAddr,
    core: Arc<Mutex<UasCore>>,
    stop: Arc<AtomicBool>,
}

impl StrictUas {
    /// A UAS over UDP on 127.0.0.1:0, answering each request to its source.
    pub fn udp(name: &str) -> StrictUas {
        StrictUas::udp_at(name, SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    /// A UAS over UDP on `at` (port 0: any), answering each request to its source.
    pub fn udp_at(name: &str, at: SocketAddr) -> StrictUas {
        let socket = UdpSocket::bind(at).expect("bind strict uas");
        socket
            .set_read_timeout(Some(Duration::from_millis(50)))
            .expect("timeout");
        let addr = socket.local_addr().expect("addr");
        let uas = StrictUas::new(name, addr, "udp");
        let (core, stop) = (Arc::clone(&uas.core), Arc::clone(&uas.stop));
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 65_536];
            while !stop.load(Ordering::Relaxed) {
                let Ok((n, src)) = socket.recv_from(&mut buf) else {
                    continue;
                };
                let (out, later) = {
                    let mut core = core.lock().expect("uas core");
                    (core.handle(&buf[..n]), core.take_later())
                };
                for r in out {
                    let _ = socket.send_to(&r, src);
                }
                for (delay, r) in later {
                    let Ok(socket) = socket.try_clone() else {
                        continue;
                    };
                    std::thread::spawn(move || {
                        std::thread::sleep(delay);
                        let _ = socket.send_to(&r, src);
                    });
                }
            }
        });
        uas
    }

    /// A UAS over TCP on 127.0.0.1:0: every accepted connection is read as a stream of
    /// Content-Length framed messages and answered on the same connection.
    pub fn tcp(name: &str) -> StrictUas {
        StrictUas::tcp_at(name, SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    /// A UAS over TCP on `at` (port 0: any), as [`StrictUas::tcp`].
    pub fn tcp_at(name: &str, at: SocketAddr) -> StrictUas {
        StrictUas::streams(name, at, "tcp", Some)
    }

    /// A UAS over TLS on `at` (port 0: any), presenting `tls`'s certificate, otherwise as
    /// [`StrictUas::tcp`]. A connection whose handshake fails is closed.
    pub fn tls_at(name: &str, at: SocketAddr, tls: Arc<rustls::ServerConfig>) -> StrictUas {
        StrictUas::tls_from(name, at, Arc::new(Mutex::new(tls)))
    }

    /// [`StrictUas::tls_at`] presenting the configuration `tls` holds when a connection is
    /// accepted: the test may replace it (a certificate re-issued) while the UAS runs.
    pub fn tls_from(
        name: &str,
        at: SocketAddr,
        tls: Arc<Mutex<Arc<rustls::ServerConfig>>>,
    ) -> StrictUas {
        StrictUas::streams(name, at, "tls", move |sock| {
            let _ = sock.set_nodelay(true);
            let cfg = Arc::clone(&*tls.lock().expect("uas tls"));
            let conn = rustls::ServerConnection::new(cfg).ok()?;
            Some(rustls::StreamOwned::new(conn, sock))
        })
    }

    /// A UAS on a TCP listener at `at`: each accepted connection, made a stream by `wrap`
    /// (`None`: closed), is read as Content-Length framed messages and answered on it, on a
    /// thread of its own.
    fn streams<S, W>(name: &str, at: SocketAddr, transport: &str, wrap: W) -> StrictUas
    where
        S: TimedRead + Write + Send + 'static,
        W: Fn(std::net::TcpStream) -> Option<S> + Send + 'static,
    {
        let listener = TcpListener::bind(at).expect("bind strict uas");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("addr");
        let uas = StrictUas::new(name, addr, transport);
        let (core, stop) = (Arc::clone(&uas.core), Arc::clone(&uas.stop));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let Ok((sock, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                let _ = sock.set_nonblocking(false);
                let Some(mut stream) = wrap(sock) else {
                    continue;
                };
                let (core, stop) = (Arc::clone(&core), Arc::clone(&stop));
                std::thread::spawn(move || {
                    let mut buf = Vec::new();
                    // Answers due later (Late), sent on this connection when due.
                    let mut later: Vec<(Instant, Vec<u8>)> = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        let now = Instant::now();
                        let (due, rest) = later.into_iter().partition(|(at, _)| *at <= now);
                        later = rest;
                        for (_, r) in due {
                            if stream.write_all(&r).is_err() {
                                return;
                            }
                        }
                        let wait = later
                            .iter()
                            .map(|(at, _)| at.saturating_duration_since(now))
                            .min()
                            .unwrap_or(Duration::from_millis(200))
                            .clamp(Duration::from_millis(1), Duration::from_millis(200));
                        let bytes = match next_message(&mut stream, &mut buf, wait) {
                            Next::Message(b) => b,
                            Next::Timeout => continue,
                            Next::Closed => return,
                        };
                        let (out, delayed) = {
                            let mut core = core.lock().expect("uas core");
                            (core.handle(&bytes), core.take_later())
                        };
                        for r in out {
                            if stream.write_all(&r).is_err() {
                                return;
                            }
                        }
                        let now = Instant::now();
                        later.extend(delayed.into_iter().map(|(d, r)| (now + d, r)));
                    }
                });
            }
        });
        uas
    }

    fn new(name: &str, addr: SocketAddr, transport: &str) -> StrictUas {
        StrictUas {
            name: name.to_owned(),
            addr,
            core: Arc::new(Mutex::new(UasCore::new(name, addr, transport))),
            stop: Arc::new(AtomicBool::new(false)),
        }
    }

    pub fn counts(&self) -> Counts {
        self.core.lock().expect("uas core").counts()
    }

    /// Turn this UAS sick (or healthy again).
    pub fn set_sick(&self, sick: Sick) {
        self.core.lock().expect("uas core").set_sick(sick);
    }

    /// The methods received for one Call-ID, in order.
    pub fn methods_of(&self, call_id: &str) -> Vec<String> {
        self.core.lock().expect("uas core").methods_of(call_id)
    }

    /// The top Via value of the last request received.
    pub fn last_via(&self) -> Option<String> {
        self.core.lock().expect("uas core").last_via()
    }

    /// The top Via value of the last request other than OPTIONS.
    pub fn last_call_via(&self) -> Option<String> {
        self.core.lock().expect("uas core").last_call_via()
    }
}

impl Drop for StrictUas {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The body of a test binary's services role run in a namespace (tests/ha.rs,
/// tests/vrrp.rs): write `uas`'s counts to `out` (one line per UAS: name requests dialogs
/// byes_ok r481 stray_acks invites) every 50 ms, and once more when stdin closes, which
/// ends the role. Each write replaces the file whole, so a reader never sees half of one.
#[allow(dead_code)]
pub fn report_counts_until_stdin_closes(uas: &[StrictUas], out: &std::path::Path) {
    use std::io::Read;
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        let _ = tx.send(());
    });
    loop {
        // The counts are written after the wait, so the last write follows the end signal.
        let stop = !matches!(
            rx.recv_timeout(Duration::from_millis(50)),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout)
        );
        let text: String = uas
            .iter()
            .map(|u| {
                let c = u.counts();
                format!(
                    "{} {} {} {} {} {} {}\n",
                    u.name, c.requests, c.dialogs, c.byes_ok, c.r481, c.stray_acks, c.invites
                )
            })
            .collect();
        let tmp = out.with_extension("tmp");
        if std::fs::write(&tmp, text).is_ok() {
            let _ = std::fs::rename(&tmp, out);
        }
        if stop {
            return;
        }
    }
}

/// The counts [`report_counts_until_stdin_closes`] last wrote to `path`, by UAS name.
#[allow(dead_code)]
pub fn read_counts(path: &std::path::Path) -> Vec<(String, Counts)> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let n = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok());
            Some((
                f.first()?.to_string(),
                Counts {
                    requests: n(1)?,
                    dialogs: n(2)?,
                    byes_ok: n(3)?,
                    r481: n(4)?,
                    stray_acks: n(5)?,
                    invites: n(6)?,
                    ..Counts::default()
                },
            ))
        })
        .collect()
}
