//! The call book of the SIP load generator over a stream (`examples/sip_tls_load.rs`, which
//! includes this file by path; tested in `tests/sip_tls.rs`): whole calls the way a phone
//! makes them over a reliable transport (INVITE, 100 / 180 / 200, ACK, BYE, 200), many at a
//! time on one connection, each call its own Call-ID.
//!
//! PURE: bytes and `now` in, bytes to send and counts out; it never reads the clock or
//! touches a socket. Over a reliable transport a UAC never retransmits (RFC 3261 §17.1.1.2,
//! §17.1.2.2: timers A and E are not started), so every latency is of one request and its
//! answer, and a request not answered within the timeout fails the call (timer B / F).
//!
//! A call fails on a final response of 300 or more to its INVITE or BYE (a misrouted BYE
//! gets 481 from a strict UAS: counted apart), on no final answer within the timeout, or when
//! the connection closes under it.

use fulcrum::sip;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// What the calls of one book (or several, merged) came to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tally {
    /// INVITEs sent.
    pub started: u64,
    /// Calls whose BYE got a 2xx.
    pub completed: u64,
    /// Calls failed by a 481 (to the INVITE or the BYE).
    pub failed_481: u64,
    /// Calls failed by another final status of 300 or more.
    pub failed_status: u64,
    /// Calls failed by no final answer within the timeout.
    pub failed_timeout: u64,
    /// Calls in progress when the connection closed.
    pub failed_closed: u64,
    /// Calls of the run never started (the connection ended, or the run's time did, first).
    pub unstarted: u64,
    /// Responses to an INVITE after its 2xx (a provisional overtaken by the 200: reordering).
    pub late: u64,
    /// Messages for no call in progress (or not SIP, or requests).
    pub stray: u64,
    /// Connections that ended under their calls (set by the IO shell).
    pub conns_lost: u64,
    /// INVITE to its 2xx, µs, one per call set up.
    pub setup_us: Vec<u32>,
    /// BYE to its 2xx, µs, one per call completed.
    pub bye_us: Vec<u32>,
}

impl Tally {
    pub fn failed(&self) -> u64 {
        self.failed_481
            + self.failed_status
            + self.failed_timeout
            + self.failed_closed
            + self.unstarted
    }

    pub fn merge(&mut self, o: Tally) {
        self.started += o.started;
        self.completed += o.completed;
        self.failed_481 += o.failed_481;
        self.failed_status += o.failed_status;
        self.failed_timeout += o.failed_timeout;
        self.failed_closed += o.failed_closed;
        self.unstarted += o.unstarted;
        self.late += o.late;
        self.stray += o.stray;
        self.conns_lost += o.conns_lost;
        self.setup_us.extend(o.setup_us);
        self.bye_us.extend(o.bye_us);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// INVITE sent, no final response yet.
    Inviting,
    /// ACK and BYE sent, waiting for the BYE's final response.
    Ending,
}

#[derive(Debug)]
struct Call {
    phase: Phase,
    /// When the request now waited for was sent.
    since: Instant,
}

/// The calls in progress on one connection.
#[derive(Debug)]
pub struct CallBook {
    local: SocketAddr,
    transport: &'static str,
    timeout: Duration,
    calls: HashMap<String, Call>,
    pub tally: Tally,
}

/// The request URI of the INVITEs (the proxy chooses the service).
const TARGET: &str = "sip:service@fulcrum.test";

impl CallBook {
    /// A book for a connection whose own address (Via, From, Contact) is `local`;
    /// `transport` is the Via's (`TLS`, `TCP`); a request unanswered for `timeout` fails.
    pub fn new(local: SocketAddr, transport: &'static str, timeout: Duration) -> CallBook {
        CallBook {
            local,
            transport,
            timeout,
            calls: HashMap::new(),
            tally: Tally::default(),
        }
    }

    /// Calls in progress.
    pub fn in_progress(&self) -> usize {
        self.calls.len()
    }

    /// Start call `call_id` at `now`: its INVITE is appended to `out`. A Call-ID already in
    /// progress is not started again.
    pub fn start(&mut self, call_id: &str, now: Instant, out: &mut Vec<u8>) {
        if self.calls.contains_key(call_id) {
            return;
        }
        self.request("INVITE", TARGET, call_id, 1)
            .write(out, None, &[]);
        self.calls.insert(
            call_id.to_owned(),
            Call {
                phase: Phase::Inviting,
                since: now,
            },
        );
        self.tally.started += 1;
    }

    /// One message received at `now`; the requests it calls for (ACK and BYE after a 2xx to
    /// an INVITE) are appended to `out`.
    pub fn on_message(&mut self, bytes: &[u8], now: Instant, out: &mut Vec<u8>) {
        let Ok(msg) = sip::scan(bytes) else {
            self.tally.stray += 1;
            return;
        };
        let (Some(code), Some(call_id), Some(cseq)) =
            (msg.status_code(), msg.call_id(), msg.cseq())
        else {
            self.tally.stray += 1;
            return;
        };
        let Some(call_id) = std::str::from_utf8(call_id).ok() else {
            self.tally.stray += 1;
            return;
        };
        let Some(call) = self.calls.get_mut(call_id) else {
            self.tally.stray += 1;
            return;
        };
        let waited = micros(now.saturating_duration_since(call.since));
        match (call.phase, cseq.method) {
            (Phase::Inviting, b"INVITE") if code < 200 => {}
            (Phase::Inviting, b"INVITE") if code < 300 => {
                self.tally.setup_us.push(waited);
                call.phase = Phase::Ending;
                call.since = now;
                let to_tag = msg
                    .to_tag()
                    .map(|t| String::from_utf8_lossy(t).into_owned());
                let mut record_route = Vec::new();
                for h in msg.headers() {
                    if h.name.eq_ignore_ascii_case(b"Record-Route") {
                        for v in String::from_utf8_lossy(h.value).split(',') {
                            record_route.push(v.trim().to_owned());
                        }
                    }
                }
                // The route set is the Record-Route in reverse at the UAC (§12.1.2); the
                // remote target is the Contact of the 2xx (§12.1.2).
                record_route.reverse();
                let target = msg.contact().map_or_else(
                    || TARGET.to_owned(),
                    |c| uri_of(&String::from_utf8_lossy(c)),
                );
                let call_id = call_id.to_owned();
                let tag = to_tag.as_deref();
                self.request("ACK", &target, &call_id, 1)
                    .write(out, tag, &record_route);
                self.request("BYE", &target, &call_id, 2)
                    .write(out, tag, &record_route);
            }
            (Phase::Ending, b"INVITE") => self.tally.late += 1,
            (Phase::Ending, b"BYE") if code < 200 => {}
            (Phase::Ending, b"BYE") if code < 300 => {
                self.tally.bye_us.push(waited);
                self.tally.completed += 1;
                self.calls.remove(call_id);
            }
            (Phase::Inviting, b"INVITE") | (Phase::Ending, b"BYE") => {
                if code == 481 {
                    self.tally.failed_481 += 1;
                } else {
                    self.tally.failed_status += 1;
                }
                self.calls.remove(call_id);
            }
            _ => self.tally.stray += 1,
        }
    }

    /// Every call whose awaited answer is older than the timeout at `now` fails.
    pub fn expire(&mut self, now: Instant) {
        let timeout = self.timeout;
        let before = self.calls.len();
        self.calls
            .retain(|_, c| now.saturating_duration_since(c.since) <= timeout);
        self.tally.failed_timeout += (before - self.calls.len()) as u64;
    }

    /// The connection closed: every call in progress fails.
    pub fn close(&mut self) {
        self.tally.failed_closed += self.calls.len() as u64;
        self.calls.clear();
    }

    /// A request of this UAC.
    fn request<'a>(
        &'a self,
        method: &'a str,
        uri: &'a str,
        call_id: &'a str,
        cseq: u32,
    ) -> Request<'a> {
        Request {
            local: self.local,
            transport: self.transport,
            method,
            uri,
            call_id,
            cseq,
        }
    }
}

/// A request of the UAC at `local` over `transport` (`TLS`, `TCP`) toward [`TARGET`]: Via
/// with a branch made of the call, CSeq and method; From tagged by the call; Contact with the
/// transport.
pub struct Request<'a> {
    pub local: SocketAddr,
    pub transport: &'a str,
    pub method: &'a str,
    pub uri: &'a str,
    pub call_id: &'a str,
    pub cseq: u32,
}

impl Request<'_> {
    /// Append the request to `out`, To tagged `to_tag` and one Route per `routes` entry.
    pub fn write(&self, out: &mut Vec<u8>, to_tag: Option<&str>, routes: &[String]) {
        let Request {
            local,
            transport: t,
            method,
            uri,
            call_id,
            cseq,
        } = *self;
        let mut s = String::with_capacity(512);
        // Writing to a String cannot fail.
        let _ = write!(
            s,
            "{method} {uri} SIP/2.0\r\n\
             Via: SIP/2.0/{t} {local};branch=z9hG4bK-{call_id}-{cseq}-{method};rport\r\n\
             Max-Forwards: 70\r\n"
        );
        for r in routes {
            let _ = write!(s, "Route: {r}\r\n");
        }
        let to_tag = to_tag.map(|t| format!(";tag={t}")).unwrap_or_default();
        let _ = write!(
            s,
            "From: <sip:uac@{local}>;tag=uac-{call_id}\r\n\
             To: <{TARGET}>{to_tag}\r\n\
             Call-ID: {call_id}\r\n\
             CSeq: {cseq} {method}\r\n\
             Contact: <sip:uac@{local};transport={}>\r\n\
             Content-Length: 0\r\n\r\n",
            t.to_ascii_lowercase()
        );
        out.extend_from_slice(s.as_bytes());
    }
}

/// The URI of a Contact (or Route) value: between `<` and `>` when bracketed, else the
/// value up to its first `;` parameter.
pub fn uri_of(value: &str) -> String {
    let v = value.trim();
    match (v.find('<'), v.find('>')) {
        (Some(a), Some(b)) if a < b => v[a + 1..b].to_owned(),
        _ => v.split(';').next().unwrap_or(v).trim().to_owned(),
    }
}

fn micros(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

/// The `p` quantile (0..=1) of sorted values (0 when empty).
pub fn quantile(sorted: &[u32], p: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() as f64 * p) as usize).min(sorted.len() - 1);
    sorted[i]
}
