//! The client-facing sockets of a sip-udp vserver, and which of them, from which local
//! address, an answer to a client leaves. IO, but for the pure choice ([`choose`]) and the
//! table of arrivals ([`Arrivals`]), which take time as an argument.
//!
//! RFC 3581 §4: a server sends its response "to the source IP address and port the request
//! came from, from the same address and port the request was sent to". A vserver bound to
//! one address does that by construction. One bound to a wildcard (`0.0.0.0:5060`, `[::]:5060`)
//! or to several addresses does not: the kernel picks the source of a wildcard socket's
//! datagram by routing (the interface's primary address, not the VRRP address or the
//! secondary address the phone used), and the answer that a service sends back arrives on
//! whichever socket faces that service, not the one the client used. A client, or a NAT or
//! firewall in front of it, then drops the answer as unsolicited. So such a vserver learns
//! each client's arrival address (IP_PKTINFO / IPV6_PKTINFO on a wildcard socket, the bound
//! address otherwise) in [`Arrivals`], and every datagram toward that client, fulcrum's own
//! answers, relayed answers and requests a service sends the client alike, leaves from it:
//! from the socket bound there, or from the wildcard socket with the address named as the
//! source (IP_PKTINFO's `ipi_spec_dst`, IPV6_PKTINFO's `ipi6_addr`).

use crate::capture::{CallId, Transport};
use crate::net;
use crate::stats::Nanos;
use dashmap::DashMap;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// How long a client's arrival address is remembered after its last datagram: longer than
/// any registration or keep-alive interval a phone uses, so that a BYE toward a caller after
/// a long call still leaves from the address the caller used.
pub(crate) const ARRIVAL_TTL: Nanos = 2 * 3600 * 1_000_000_000;

/// At most this many clients are remembered (about 80 bytes each); a client past it is
/// answered from the kernel's choice of source, as without this table, and counted.
pub(crate) const ARRIVAL_CAP: usize = 1 << 20;

/// How often the table drops the clients silent for longer than [`ARRIVAL_TTL`].
const SWEEP_EVERY: Nanos = 60 * 1_000_000_000;

/// A stamp is rewritten only when it is older than this: a client sending many datagrams a
/// second reads the table, it does not write it.
const RESTAMP_AFTER: Nanos = 1_000_000_000;

/// Which local address each client last sent to. Shared by a vserver's workers (a client's
/// datagrams reach one worker, the answers its services send may reach any).
#[derive(Debug, Default)]
pub(crate) struct Arrivals {
    map: DashMap<SocketAddr, (SocketAddr, Nanos)>,
    next_sweep: AtomicU64,
    /// Clients not remembered because the table was full.
    pub full: AtomicU64,
    len_hint: AtomicUsize,
}

impl Arrivals {
    /// `client` sent a datagram to `local` at `now`.
    pub(crate) fn note(&self, client: SocketAddr, local: SocketAddr, now: Nanos) {
        if let Some(e) = self.map.get(&client)
            && e.0 == local
            && now.saturating_sub(e.1) < RESTAMP_AFTER
        {
            return;
        }
        if self.len_hint.load(Ordering::Relaxed) >= ARRIVAL_CAP && !self.map.contains_key(&client) {
            if self.full.fetch_add(1, Ordering::Relaxed) == 0 {
                tracing::warn!(
                    clients = ARRIVAL_CAP,
                    "the table of client arrival addresses is full: clients past it are answered from the kernel's choice of source address"
                );
            }
            return;
        }
        self.map.insert(client, (local, now));
        self.len_hint.store(self.map.len(), Ordering::Relaxed);
    }

    /// The local address `client` last sent to, if remembered.
    pub(crate) fn local_of(&self, client: SocketAddr) -> Option<SocketAddr> {
        self.map.get(&client).map(|e| e.0)
    }

    /// Drop the clients silent for longer than [`ARRIVAL_TTL`], at most once per
    /// [`SWEEP_EVERY`] whoever calls (one caller wins each round). The number dropped.
    pub(crate) fn sweep_if_due(&self, now: Nanos) -> usize {
        let due = self.next_sweep.load(Ordering::Relaxed);
        if now < due
            || self
                .next_sweep
                .compare_exchange(due, now + SWEEP_EVERY, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return 0;
        }
        let before = self.map.len();
        self.map
            .retain(|_, (_, stamp)| now.saturating_sub(*stamp) <= ARRIVAL_TTL);
        let after = self.map.len();
        self.len_hint.store(after, Ordering::Relaxed);
        before - after
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.map.len()
    }
}

/// Which of `bound` (the client-facing sockets' addresses) sends to `to`, and the source
/// address to name (IP_PKTINFO) when the socket cannot say it by itself. `local` is where
/// the client sent to (when known); `default` the socket to use otherwise (the caller's
/// own). Prefers, in order: the socket bound at `local`; a wildcard socket of `local`'s port
/// and family, naming `local`; a socket bound to another address of that port and family,
/// naming `local`; else `default` if its family fits `to`, else the first socket of
/// `to`'s family, naming nothing.
pub(crate) fn choose(
    bound: &[SocketAddr],
    local: Option<SocketAddr>,
    to: SocketAddr,
    default: usize,
) -> (usize, Option<IpAddr>) {
    if let Some(l) = local.filter(|l| l.is_ipv4() == to.is_ipv4()) {
        if let Some(i) = bound.iter().position(|b| *b == l) {
            return (i, None);
        }
        let same_port = |b: &SocketAddr| b.port() == l.port() && b.is_ipv4() == l.is_ipv4();
        if let Some(i) = bound
            .iter()
            .position(|b| same_port(b) && b.ip().is_unspecified())
        {
            return (i, Some(l.ip()));
        }
        if let Some(i) = bound.iter().position(same_port) {
            return (i, Some(l.ip()));
        }
    }
    match bound.get(default) {
        Some(b) if b.is_ipv4() == to.is_ipv4() => (default, None),
        _ => (
            bound
                .iter()
                .position(|b| b.is_ipv4() == to.is_ipv4())
                .unwrap_or(default),
            None,
        ),
    }
}

/// Whether a vserver bound at `bound` must learn its clients' arrival addresses: a wildcard
/// bind, or more than one address. One specific address answers from it by construction.
pub(crate) fn needs_arrivals(bound: &[SocketAddr]) -> bool {
    bound.len() > 1 || bound.iter().any(|b| b.ip().is_unspecified())
}

/// The client-facing side of a vserver with several addresses or a wildcard bind: one
/// socket per bound address, and the table of arrivals.
#[derive(Debug)]
pub(crate) struct Fronts {
    bound: Vec<SocketAddr>,
    sockets: Vec<UdpSocket>,
    pub arrivals: Arrivals,
}

impl Fronts {
    /// One clone of a worker socket per bound address (`per_addr[i][0]` for `bound[i]`).
    pub(crate) fn of(bound: &[SocketAddr], per_addr: &[Vec<UdpSocket>]) -> std::io::Result<Self> {
        let mut sockets = Vec::with_capacity(bound.len());
        for socks in per_addr {
            if let Some(s) = socks.first() {
                sockets.push(s.try_clone()?);
            }
        }
        Ok(Fronts {
            bound: bound[..sockets.len().min(bound.len())].to_vec(),
            sockets,
            arrivals: Arrivals::default(),
        })
    }
}

/// The sockets a worker sends from: toward clients (one of the vserver's) and toward
/// services (one bound at `service_source`, else the same as toward clients); with
/// [`Fronts`], toward each client from the address it sent to.
#[derive(Debug)]
pub(crate) struct Senders {
    pub clients: UdpSocket,
    pub services: UdpSocket,
    /// The local addresses of `clients` and `services` (the source a capture names).
    clients_addr: SocketAddr,
    services_addr: SocketAddr,
    /// Every datagram sent is captured here (docs/capture.md).
    tap: Option<crate::capture::Tap>,
    /// `clients`'s index among the fronts' sockets.
    rank: usize,
    fronts: Option<Arc<Fronts>>,
}

impl Senders {
    /// Clones of `clients` and, when given, `services` (else `clients` again).
    pub(crate) fn of(clients: &UdpSocket, services: Option<&UdpSocket>) -> std::io::Result<Self> {
        let services = services.unwrap_or(clients);
        Ok(Senders {
            clients_addr: clients.local_addr()?,
            services_addr: services.local_addr()?,
            clients: clients.try_clone()?,
            services: services.try_clone()?,
            tap: None,
            rank: 0,
            fronts: None,
        })
    }

    /// These senders capturing every datagram they send.
    pub(crate) fn with_tap(mut self, tap: crate::capture::Tap) -> Self {
        self.tap = Some(tap);
        self
    }

    /// The local address of `services` (the source a capture names).
    pub(crate) fn services_addr(&self) -> SocketAddr {
        self.services_addr
    }

    /// The capture tap, for the receive side of the same worker.
    pub(crate) fn tap(&self) -> Option<&crate::capture::Tap> {
        self.tap.as_ref()
    }

    /// Send `bytes` to `to`, a service, from the service-facing socket; `call_id`: its
    /// Call-ID for the capture, when known.
    pub(crate) fn to_service(
        &self,
        bytes: &[u8],
        to: SocketAddr,
        call_id: CallId<'_>,
    ) -> std::io::Result<usize> {
        let at = self.tap.as_ref().and_then(crate::capture::Tap::stamp);
        let n = self.services.send_to(bytes, to)?;
        if let (Some(t), Some(at)) = (&self.tap, at) {
            let leg = (Transport::Udp, self.services_addr, to);
            t.tap_as(at, leg, bytes, call_id);
        }
        Ok(n)
    }

    /// These senders answering each client from the address it sent to; `clients` is the
    /// socket of `fronts`'s address `rank`.
    pub(crate) fn with_fronts(mut self, fronts: &Option<Arc<Fronts>>, rank: usize) -> Self {
        self.fronts = fronts.clone();
        self.rank = rank;
        self
    }

    /// Send `bytes` to `to`, a client (anyone but a service): from the address `to` last
    /// sent to when the vserver has several or a wildcard (RFC 3581 §4). `dontwait`: do not
    /// block on a full send buffer (the datagram is lost; SIP retransmits it). `call_id`:
    /// its Call-ID for the capture, when known.
    pub(crate) fn to_client(
        &self,
        bytes: &[u8],
        to: SocketAddr,
        dontwait: bool,
        call_id: CallId<'_>,
    ) -> std::io::Result<usize> {
        let at = self.tap.as_ref().and_then(crate::capture::Tap::stamp);
        let Some(f) = &self.fronts else {
            let n = net::send_from(&self.clients, bytes, to, None, dontwait)?;
            if let (Some(t), Some(at)) = (&self.tap, at) {
                let leg = (Transport::Udp, self.clients_addr, to);
                t.tap_as(at, leg, bytes, call_id);
            }
            return Ok(n);
        };
        let (i, from) = choose(&f.bound, f.arrivals.local_of(to), to, self.rank);
        let socket = f.sockets.get(i).unwrap_or(&self.clients);
        let n = net::send_from(socket, bytes, to, from, dontwait)?;
        if let (Some(t), Some(at)) = (&self.tap, at) {
            let bound = f.bound.get(i).copied().unwrap_or(self.clients_addr);
            let src = from.map_or(bound, |ip| SocketAddr::new(ip, bound.port()));
            t.tap_as(at, (Transport::Udp, src, to), bytes, call_id);
        }
        Ok(n)
    }

    /// The table of arrivals, when the vserver keeps one and `bound` (a receiving socket's
    /// address) faces clients: a `service_source` socket's datagrams are not noted.
    pub(crate) fn arrivals_at(&self, bound: SocketAddr) -> Option<&Arrivals> {
        self.fronts
            .as_deref()
            .filter(|f| f.bound.contains(&bound))
            .map(|f| &f.arrivals)
    }
}

/// Whether a received message is captured: all but those fulcrum dropped (access lists,
/// flood control, no route, not SIP at all), which took no part in a call; a message a held
/// transaction absorbed (a retransmission, the ACK of fulcrum's final, a failed attempt's
/// answer) did (docs/capture.md).
pub(crate) fn is_captured(action: &crate::core::sip::Action) -> bool {
    !matches!(action, crate::core::sip::Action::Drop(r) if *r != crate::core::sip::DropReason::Absorbed)
}

/// The Call-ID a data path hands the capture of a message the core decided on, of what it
/// forwards of it and of fulcrum's answer to it: the one the core's scan read (RFC 3261
/// §16.6, §8.2.6.2: they all carry it), else a search.
pub(crate) fn handed(scanned: crate::core::sip::Scanned<'_>) -> CallId<'_> {
    match scanned {
        crate::core::sip::Scanned::CallId(c) => CallId::Is(c),
        crate::core::sip::Scanned::No => CallId::Find,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> SocketAddr {
        s.parse().expect("address")
    }

    #[test]
    fn a_client_is_answered_from_the_socket_bound_where_it_sent() {
        let bound = [a("10.0.0.1:5060"), a("10.0.0.2:5060")];
        assert_eq!(
            choose(&bound, Some(a("10.0.0.2:5060")), a("192.0.2.9:5060"), 0),
            (1, None)
        );
        assert_eq!(
            choose(&bound, Some(a("10.0.0.1:5060")), a("192.0.2.9:5060"), 1),
            (0, None)
        );
    }

    #[test]
    fn a_wildcard_socket_names_the_arrival_address_as_the_source() {
        let bound = [a("0.0.0.0:5060"), a("[::]:5060")];
        assert_eq!(
            choose(&bound, Some(a("10.0.0.7:5060")), a("192.0.2.9:5060"), 0),
            (0, Some("10.0.0.7".parse().expect("ip")))
        );
        assert_eq!(
            choose(
                &bound,
                Some(a("[2001:db8::7]:5060")),
                a("[2001:db8::9]:5060"),
                0
            ),
            (1, Some("2001:db8::7".parse().expect("ip")))
        );
    }

    #[test]
    fn an_unknown_client_gets_a_socket_of_its_family() {
        let bound = [a("[::1]:5060"), a("127.0.0.1:5060")];
        assert_eq!(choose(&bound, None, a("127.0.0.2:40000"), 0), (1, None));
        assert_eq!(choose(&bound, None, a("[::1]:40000"), 0), (0, None));
        // An arrival of the other family (a stale entry) is not used.
        assert_eq!(
            choose(&bound, Some(a("[::1]:5060")), a("127.0.0.2:40000"), 0),
            (1, None)
        );
    }

    #[test]
    fn the_table_remembers_the_last_arrival_and_forgets_silent_clients() {
        let t = Arrivals::default();
        let c = a("192.0.2.9:5060");
        t.note(c, a("10.0.0.1:5060"), 0);
        assert_eq!(t.local_of(c), Some(a("10.0.0.1:5060")));
        // Another address at once: the new one (not held back by the restamp delay).
        t.note(c, a("10.0.0.2:5060"), 10);
        assert_eq!(t.local_of(c), Some(a("10.0.0.2:5060")));
        assert_eq!(t.sweep_if_due(ARRIVAL_TTL), 0, "not silent long enough");
        assert_eq!(t.sweep_if_due(ARRIVAL_TTL + 20), 0, "one sweep a minute");
        assert_eq!(t.sweep_if_due(ARRIVAL_TTL + SWEEP_EVERY + 20), 1);
        assert_eq!((t.local_of(c), t.len()), (None, 0));
        assert!(needs_arrivals(&[a("0.0.0.0:5060")]));
        assert!(needs_arrivals(&[a("10.0.0.1:5060"), a("10.0.0.2:5060")]));
        assert!(!needs_arrivals(&[a("10.0.0.1:5060")]));
    }

    /// A sip-udp core on 192.0.2.1:5060 (the fixtures' proxy Via: their responses are
    /// fulcrum's) over services a and b, failover on (the default).
    fn fixture_core() -> crate::core::sip::SipCore {
        use crate::core::sip::{SipCore, SipParams};
        let y = "services:\n  - { name: a, address: 127.0.0.1:5071, protocol: sip-udp }\n  - { name: b, address: 127.0.0.1:5072, protocol: sip-udp }\nvservers:\n  - { name: v, protocol: sip-udp, bind: 127.0.0.1:5060, services: [a, b] }\n";
        let cfg = crate::config::from_str("t", y).expect("config");
        let v = &cfg.vservers[0];
        let local = crate::sip::Local::from_addr(a("192.0.2.1:5060"), crate::sip::Transport::Udp);
        let balancer = Arc::new(crate::balancer::Balancer::new(&cfg, v));
        SipCore::new(SipParams::of(&cfg, v, local, balancer))
            .with_failover(v.failover.clone(), Arc::default())
    }

    /// What the capture is handed for a message and what its decision sends equals what
    /// `call_id_of` finds in each: the message, the bytes its action sends (forwarded, or
    /// fulcrum's answer), and the held request's sends the core says carry it. `what`
    /// names the case in a failure.
    fn check_handed(
        what: &str,
        buf: &[u8],
        d: crate::core::sip::Decision<'_>,
        out: &[u8],
        sends: &[crate::core::sip::stateful::Send],
    ) -> usize {
        use crate::capture::call_id_of;
        use crate::core::sip::{Action, stateful::Carries};
        let CallId::Is(handed) = handed(d.call_id) else {
            return 0;
        };
        assert_eq!(handed, call_id_of(buf), "{what}: received");
        let mut checked = 1;
        if matches!(
            d.action,
            Action::ToMember(_) | Action::ToAddr(_) | Action::Reply(_)
        ) {
            assert_eq!(handed, call_id_of(out), "{what}: {:?}", d.action);
            checked += 1;
        }
        for s in sends.iter().filter(|s| s.call_id == Carries::Handled) {
            assert_eq!(handed, call_id_of(&s.bytes), "{what}: {s:?}");
            checked += 1;
        }
        checked
    }

    /// Every fixture, as a client's datagram: the Call-ID the core hands on is what a search
    /// finds, in what it received and in everything it sends of it or for it.
    #[test]
    fn the_handed_call_id_is_the_one_found_in_every_fixture() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/sip");
        let mut files: Vec<_> = ["", "rfc4475"]
            .iter()
            .flat_map(|sub| std::fs::read_dir(dir.join(sub)).expect("fixtures"))
            .map(|e| e.expect("entry").path())
            .filter(|p| p.extension().is_some_and(|x| x == "sip"))
            .collect();
        files.sort();
        assert!(files.len() > 60, "{}", files.len());
        let mut checked = 0;
        for f in &files {
            let buf = std::fs::read(f).expect("fixture");
            let c = fixture_core();
            let (mut out, mut sends) = (Vec::new(), Vec::new());
            let d = c.decide_datagram_stateful(
                &buf,
                a("198.51.100.7:40000"),
                a("192.0.2.1:5060"),
                0,
                &mut out,
                &mut sends,
            );
            checked += check_handed(&f.display().to_string(), &buf, d, &out, &sends);
        }
        assert!(checked > 100, "{checked}");
    }

    /// The Via lines of a message, each with its CRLF.
    fn vias_of(msg: &str) -> String {
        msg.lines()
            .filter(|l| l.starts_with("Via:"))
            .map(|l| format!("{l}\r\n"))
            .collect()
    }

    /// A held INVITE's own messages: its 100 Trying, the ACK of a failed attempt's 503 and
    /// the next attempt, the 200 to the client's CANCEL and the CANCEL sent on; each carries
    /// the Call-ID the core hands on.
    #[test]
    fn a_held_requests_own_messages_carry_the_handed_call_id() {
        use crate::core::sip::{Action, Origin, stateful::Carries};
        let c = fixture_core();
        let client = a("198.51.100.7:40000");
        let us = a("192.0.2.1:5060");
        let invite = "INVITE sip:bob@biloxi.example.com SIP/2.0\r\nVia: SIP/2.0/UDP 198.51.100.7:40000;branch=z9hG4bKheld1;rport\r\nMax-Forwards: 70\r\nFrom: <sip:alice@atlanta.example.com>;tag=f1\r\nTo: <sip:bob@biloxi.example.com>\r\nCall-ID: held-1@atlanta\r\nCSeq: 1 INVITE\r\nContent-Length: 0\r\n\r\n";
        let (mut out, mut sends) = (Vec::new(), Vec::new());
        let d = c.decide_datagram_stateful(invite.as_bytes(), client, us, 0, &mut out, &mut sends);
        let Action::ToMember(m) = d.action else {
            panic!("{d:?}")
        };
        assert_eq!(sends.len(), 1, "the 100 Trying: {sends:?}");
        assert_eq!(sends[0].call_id, Carries::Handled);
        check_handed("invite", invite.as_bytes(), d, &out, &sends);
        // The attempt's service answers 503: ACKed, and the INVITE goes to the other one.
        let vias = vias_of(std::str::from_utf8(&out).expect("text"));
        let busy = format!(
            "SIP/2.0 503 Service Unavailable\r\n{vias}From: <sip:alice@atlanta.example.com>;tag=f1\r\nTo: <sip:bob@biloxi.example.com>;tag=s1\r\nCall-ID: held-1@atlanta\r\nCSeq: 1 INVITE\r\nContent-Length: 0\r\n\r\n"
        );
        let member = c.member_addr(m).expect("member");
        sends.clear();
        let d = c.decide_stateful(
            busy.as_bytes(),
            Origin::Member(m),
            member,
            us,
            1,
            &mut out,
            &mut sends,
        );
        assert!(
            sends.len() >= 2 && sends.iter().all(|s| s.call_id == Carries::Handled),
            "{sends:?}"
        );
        check_handed("503", busy.as_bytes(), d, &out, &sends);
        // The next attempt rings (a CANCEL waits for a provisional answer, RFC 3261 §9.1).
        let next = sends
            .iter()
            .find(|s| s.bytes.starts_with(b"INVITE"))
            .expect("the next attempt");
        let crate::core::sip::stateful::Dest::Service(other) = next.dest else {
            panic!("{next:?}")
        };
        let vias = vias_of(std::str::from_utf8(&next.bytes).expect("text"));
        let ringing = busy
            .replacen("503 Service Unavailable", "180 Ringing", 1)
            .replace(&vias_of(&busy), &vias);
        let m2 = c.member_of(other).expect("the other member");
        sends.clear();
        let d = c.decide_stateful(
            ringing.as_bytes(),
            Origin::Member(m2),
            other,
            us,
            2,
            &mut out,
            &mut sends,
        );
        assert!(matches!(d.action, Action::ToAddr(_)), "{d:?}");
        check_handed("180", ringing.as_bytes(), d, &out, &sends);
        // The client's CANCEL: fulcrum's 200, and a CANCEL toward the new attempt.
        let cancel = invite
            .replacen("INVITE sip:", "CANCEL sip:", 1)
            .replace("CSeq: 1 INVITE", "CSeq: 1 CANCEL");
        sends.clear();
        let d = c.decide_datagram_stateful(cancel.as_bytes(), client, us, 3, &mut out, &mut sends);
        assert!(
            sends.len() >= 2 && sends.iter().all(|s| s.call_id == Carries::Handled),
            "{sends:?}"
        );
        check_handed("cancel", cancel.as_bytes(), d, &out, &sends);
        // Another INVITE, ringing, CANCELed by a message that reuses its branch with another
        // Call-ID: the CANCEL sent on for the held INVITE is not said to carry the CANCEL's.
        let second = invite
            .replace("z9hG4bKheld1", "z9hG4bKheld2")
            .replace("held-1@atlanta", "held-2@atlanta");
        sends.clear();
        let d = c.decide_datagram_stateful(second.as_bytes(), client, us, 4, &mut out, &mut sends);
        let Action::ToMember(m) = d.action else {
            panic!("{d:?}")
        };
        let ringing = format!(
            "SIP/2.0 180 Ringing\r\n{}From: <sip:alice@atlanta.example.com>;tag=f1\r\nTo: <sip:bob@biloxi.example.com>;tag=s2\r\nCall-ID: held-2@atlanta\r\nCSeq: 1 INVITE\r\nContent-Length: 0\r\n\r\n",
            vias_of(std::str::from_utf8(&out).expect("text"))
        );
        let member = c.member_addr(m).expect("member");
        let origin = Origin::Member(m);
        c.decide_stateful(
            ringing.as_bytes(),
            origin,
            member,
            us,
            5,
            &mut out,
            &mut sends,
        );
        let forged = second
            .replacen("INVITE sip:", "CANCEL sip:", 1)
            .replace("CSeq: 1 INVITE", "CSeq: 1 CANCEL")
            .replace("held-2@atlanta", "other@elsewhere");
        sends.clear();
        let d = c.decide_datagram_stateful(forged.as_bytes(), client, us, 6, &mut out, &mut sends);
        check_handed("forged cancel", forged.as_bytes(), d, &out, &sends);
        let on = sends
            .iter()
            .find(|s| s.bytes.starts_with(b"CANCEL"))
            .expect("the CANCEL sent on");
        assert_eq!(on.call_id, Carries::Unknown);
        assert_eq!(
            crate::capture::call_id_of(&on.bytes),
            Some(&b"held-2@atlanta"[..])
        );
    }

    #[test]
    fn every_message_but_those_dropped_is_captured() {
        let a: SocketAddr = "127.0.0.1:5060".parse().expect("addr");
        for kept in [
            crate::core::sip::Action::ToMember(0),
            crate::core::sip::Action::ToAddr(a),
            crate::core::sip::Action::Reply(a),
            crate::core::sip::Action::Drop(crate::core::sip::DropReason::Absorbed),
        ] {
            assert!(is_captured(&kept), "{kept:?}");
        }
        for dropped in [
            crate::core::sip::DropReason::Malformed,
            crate::core::sip::DropReason::NotOurs,
            crate::core::sip::DropReason::Loop,
            crate::core::sip::DropReason::Unroutable,
            crate::core::sip::DropReason::AckNotForwarded,
            crate::core::sip::DropReason::Acl,
            crate::core::sip::DropReason::Flood,
            crate::core::sip::DropReason::Routed,
        ] {
            assert!(
                !is_captured(&crate::core::sip::Action::Drop(dropped)),
                "{dropped:?}"
            );
        }
    }
}
