//! A SIP UAC over a blocking stream (TCP, or TLS over TCP), for the stream tests: it makes
//! whole calls (INVITE, its final response, ACK, BYE, its final response) the way a phone
//! does, following the Record-Route set the 200 brings (RFC 3261 §12.1.2, §12.2.1.1).

use super::sip_load::Request;
use super::sip_tcp::{Next, TimedRead, next_message};
use fulcrum::sip;
use std::io::Write;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// What one call saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Call {
    /// Final status of the INVITE (0: none within the wait).
    pub invite: u16,
    /// Final status of the BYE (0: none within the wait, or never sent).
    pub bye: u16,
    /// Record-Route values of the 200 to the INVITE, top first.
    pub record_route: Vec<String>,
}

/// A UAC over `stream`, whose own address (for Via, From and Contact) is `local`.
pub struct Uac<S> {
    pub stream: S,
    local: SocketAddr,
    transport: &'static str,
    buf: Vec<u8>,
    pub wait: Duration,
}

impl<S: TimedRead + Write> Uac<S> {
    /// `transport` is the Via's: `TCP` or `TLS`.
    pub fn new(stream: S, local: SocketAddr, transport: &'static str) -> Uac<S> {
        Uac {
            stream,
            local,
            transport,
            buf: Vec::new(),
            wait: Duration::from_secs(5),
        }
    }

    fn request(
        &self,
        method: &str,
        uri: &str,
        call_id: &str,
        cseq: u32,
        to_tag: Option<&str>,
        routes: &[String],
    ) -> String {
        let req = Request {
            local: self.local,
            transport: self.transport,
            method,
            uri,
            call_id,
            cseq,
        };
        let mut out = Vec::new();
        req.write(&mut out, to_tag, routes);
        String::from_utf8_lossy(&out).into_owned()
    }

    /// The final response to (`call_id`, `method`) within the wait, provisional ones and
    /// other messages skipped.
    fn final_response(&mut self, call_id: &str, method: &str) -> Option<Vec<u8>> {
        let end = Instant::now() + self.wait;
        while Instant::now() < end {
            let left = end.saturating_duration_since(Instant::now());
            let bytes = match next_message(&mut self.stream, &mut self.buf, left) {
                Next::Message(b) => b,
                Next::Timeout | Next::Closed => return None,
            };
            let Ok(msg) = sip::scan(&bytes) else { continue };
            let ours = msg.call_id() == Some(call_id.as_bytes())
                && msg.cseq().is_some_and(|c| c.method == method.as_bytes());
            if !msg.is_request() && ours && msg.status_code().is_some_and(|c| c >= 200) {
                return Some(bytes);
            }
        }
        None
    }

    /// One whole call with Call-ID `call_id`.
    pub fn call(&mut self, call_id: &str) -> Call {
        let mut call = Call::default();
        let uri = "sip:service@fulcrum.test";
        let invite = self.request("INVITE", uri, call_id, 1, None, &[]);
        if self.stream.write_all(invite.as_bytes()).is_err() {
            return call;
        }
        let Some(ok) = self.final_response(call_id, "INVITE") else {
            return call;
        };
        let Ok(msg) = sip::scan(&ok) else { return call };
        call.invite = msg.status_code().unwrap_or(0);
        if call.invite != 200 {
            return call;
        }
        let to_tag = msg
            .to_tag()
            .map(|t| String::from_utf8_lossy(t).into_owned());
        for h in msg.headers() {
            if h.name.eq_ignore_ascii_case(b"Record-Route") {
                for v in String::from_utf8_lossy(h.value).split(',') {
                    call.record_route.push(v.trim().to_owned());
                }
            }
        }
        let target = msg
            .contact()
            .map(|c| {
                let c = String::from_utf8_lossy(c).into_owned();
                c.trim_matches(|ch| ch == '<' || ch == '>' || ch == ' ')
                    .to_owned()
            })
            .unwrap_or_else(|| uri.to_owned());
        // The route set is the Record-Route in reverse at the UAC (§12.1.2).
        let routes: Vec<String> = call.record_route.iter().rev().cloned().collect();
        let ack = self.request("ACK", &target, call_id, 1, to_tag.as_deref(), &routes);
        let bye = self.request("BYE", &target, call_id, 2, to_tag.as_deref(), &routes);
        if self.stream.write_all(ack.as_bytes()).is_err()
            || self.stream.write_all(bye.as_bytes()).is_err()
        {
            return call;
        }
        call.bye = self
            .final_response(call_id, "BYE")
            .and_then(|b| sip::scan(&b).ok().and_then(|m| m.status_code()))
            .unwrap_or(0);
        call
    }
}

/// A connected UDP socket as the UAC's stream: one datagram per message.
pub struct UdpStream(pub std::net::UdpSocket);

impl std::io::Read for UdpStream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.recv(buf)
    }
}

impl Write for UdpStream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.send(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl TimedRead for UdpStream {
    fn set_read_timeout(&self, d: Option<Duration>) -> std::io::Result<()> {
        self.0.set_read_timeout(d)
    }
}
