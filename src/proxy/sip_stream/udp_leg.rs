//! The UDP leg: the socket a SIP stream vserver reaches its sip-udp members on (the
//! transports bridge, docs/sip.md), and a sip-udp bridge's way back to its clients. IO.

use super::*;
use crate::capture::Transport::Udp;

impl SipStreamShared {
    /// Send `bytes` to `addr`, a client (or anyone but a sip-udp member), over the UDP leg
    /// or from a sip-udp vserver's own socket. A datagram path does not wait: a full send
    /// buffer loses the datagram (counted), and SIP retransmits it (RFC 3261 §17.1.1.2).
    /// `call_id`: its Call-ID for the capture, when known.
    pub(super) fn to_udp(&self, bytes: &[u8], addr: SocketAddr, call_id: CallId<'_>) -> bool {
        if let Some(front) = &self.front {
            // Without waiting (the socket blocks for its worker's receive; MSG_DONTWAIT keeps
            // this send from blocking a link's task on a full send buffer: the datagram is
            // lost and counted, as on the leg), from the address the client sent to.
            return self.datagram_sent(front.to_client(bytes, addr, true, call_id), addr);
        }
        self.to_leg(bytes, addr, call_id)
    }

    /// Send `bytes` to `addr`, a sip-udp member: over the UDP leg, or from a sip-udp
    /// vserver's `service_source` socket when it has one (its Via names that address).
    /// `call_id`: its Call-ID for the capture, when known.
    pub(super) fn to_udp_member(
        &self,
        bytes: &[u8],
        addr: SocketAddr,
        call_id: CallId<'_>,
    ) -> bool {
        if let Some(front) = &self.front {
            let at = self.tap.stamp();
            let sent = self.to_front(&front.services, bytes, addr);
            if sent && let Some(at) = at {
                let leg = (Udp, front.services_addr(), addr);
                self.tap.tap_as(at, leg, bytes, call_id);
            }
            return sent;
        }
        self.to_leg(bytes, addr, call_id)
    }

    fn to_leg(&self, bytes: &[u8], addr: SocketAddr, call_id: CallId<'_>) -> bool {
        let Some(sock) = &self.udp else {
            bump(&self.counters.udp_leg_send_errors);
            return false;
        };
        let addr = udp_target(sock, addr);
        let at = self.tap.stamp();
        let sent = self.datagram_sent(sock.try_send_to(bytes, addr), addr);
        if sent
            && let Some(at) = at
            && let Ok(local) = sock.local_addr()
        {
            self.tap.tap_as(at, (Udp, local, addr), bytes, call_id);
        }
        sent
    }

    /// Whether a datagram to `addr` went out; one that did not is counted (and logged, at a
    /// limited rate).
    pub(super) fn datagram_sent(&self, sent: std::io::Result<usize>, addr: SocketAddr) -> bool {
        match sent {
            Ok(_) => true,
            Err(e) => {
                bump(&self.counters.udp_leg_send_errors);
                if self.log.allow(self.now()) {
                    tracing::debug!(vserver = %self.name, %addr, error = %e, "UDP send failed");
                }
                false
            }
        }
    }

    /// Send `bytes` to `addr` from the sip-udp vserver's socket `front`, without waiting (the
    /// socket blocks for its worker's receive; MSG_DONTWAIT keeps this send from blocking a
    /// link's task on a full send buffer: the datagram is lost and counted, as on the leg).
    pub(super) fn to_front(
        &self,
        front: &std::net::UdpSocket,
        bytes: &[u8],
        addr: SocketAddr,
    ) -> bool {
        let sent = socket2::SockRef::from(front).send_to_with_flags(
            bytes,
            &addr.into(),
            nix::libc::MSG_DONTWAIT,
        );
        self.datagram_sent(sent, addr)
    }
}

/// Where a datagram to `addr` goes from `sock`: an IPv4 target is mapped when the socket is
/// IPv6 (a wildcard `[::]` bind is dual-stack).
pub(super) fn udp_target(sock: &tokio::net::UdpSocket, addr: SocketAddr) -> SocketAddr {
    match (sock.local_addr(), addr.ip()) {
        (Ok(SocketAddr::V6(_)), std::net::IpAddr::V4(v4)) => {
            SocketAddr::new(std::net::IpAddr::V6(v4.to_ipv6_mapped()), addr.port())
        }
        _ => addr,
    }
}

/// The UDP leg's receive loop: what sip-udp members send there (responses to the requests
/// fulcrum forwarded, held ones included, their in-dialog requests toward clients, their
/// answers to the clients' in-dialog requests) is handled as theirs by the current core and
/// carried out like a message read from a link. Datagrams from anyone else are dropped: the
/// leg faces the services, clients reach the vserver on its listener.
pub(super) async fn udp_leg_loop(shared: Arc<SipStreamShared>, sock: Arc<tokio::net::UdpSocket>) {
    let dst = sock
        .local_addr()
        .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)));
    let mut buf = vec![0u8; 65_536];
    let mut sends = Vec::new();
    let reader = shared.readers.register();
    // fulcrum's own replies to a service's request go back as datagrams, not on a queue.
    loop {
        let (n, src) = match sock.recv_from(&mut buf).await {
            Ok(r) => r,
            Err(e) => {
                if shared.log.allow(shared.now()) {
                    tracing::debug!(vserver = %shared.name, error = %e, "UDP leg receive failed");
                }
                continue;
            }
        };
        let at = shared.tap.stamp();
        let src = SocketAddr::new(src.ip().to_canonical(), src.port());
        OUT.with_borrow_mut(|out| {
            let _in = reader.enter();
            let g = shared.current.load();
            let Some(m) = g.core.udp_member_of(src) else {
                bump(&shared.counters.udp_leg_strangers);
                return;
            };
            let origin = Origin::Member(m);
            let now = shared.now();
            let d = g
                .core
                .decide_stateful(&buf[..n], origin, src, dst, now, out, &mut sends);
            let (call_id, queued) = handed_on(at, &d, &sends);
            if let Some(at) = at
                && crate::proxy::sip_front::is_captured(&d.action)
            {
                shared.tap.tap_as(at, (Udp, src, dst), &buf[..n], call_id);
            }
            // A held request's own messages first (the next attempt after a 503, the ACK).
            shared.carry_sends(&g, std::mem::take(&mut sends), &queued);
            match d.action {
                Action::Reply(addr) => {
                    shared.to_udp(out, addr, call_id);
                }
                action => shared.dispatch(&g, action, out, origin, ReplyTo::Nowhere, &queued),
            }
        });
    }
}

/// Bind the UDP leg of stream vserver `v` toward its sip-udp members: the first bind
/// address's IP with an ephemeral port (docs/sip.md says why), and fulcrum's identity on
/// it (the IP toward the first such member when the bind is a wildcard).
pub(super) fn bind_udp_leg(
    ctx: &StartCtx<'_>,
    v: &Vserver,
    bound: &[SocketAddr],
    udp_members: &[SocketAddr],
) -> Result<(Arc<tokio::net::UdpSocket>, Local), RuntimeError> {
    let setup = |problem: String| RuntimeError::Setup {
        vserver: v.name.clone(),
        problem,
    };
    let first = *bound
        .first()
        .ok_or_else(|| setup("no bind address".into()))?;
    // `service_source` gives the leg a stable address (the one fulcrum's Path and
    // Record-Route name toward the services, which must outlive a restart); else the first
    // bind address's IP with an ephemeral port.
    let at = v
        .service_source
        .unwrap_or_else(|| SocketAddr::new(first.ip(), 0));
    let bind_err = |source| RuntimeError::Bind {
        vserver: v.name.clone(),
        addr: at,
        source,
    };
    // With `freebind`, the leg binds the VIP a standby does not hold yet, as the listeners do.
    let sock = {
        let s = socket2::Socket::new(
            socket2::Domain::for_address(at),
            socket2::Type::DGRAM,
            Some(socket2::Protocol::UDP),
        )
        .map_err(bind_err)?;
        if v.freebind {
            if at.is_ipv6() {
                s.set_freebind_v6(true).map_err(bind_err)?;
            } else {
                s.set_freebind_v4(true).map_err(bind_err)?;
            }
        }
        s.bind(&at.into()).map_err(bind_err)?;
        std::net::UdpSocket::from(s)
    };
    sock.set_nonblocking(true).map_err(bind_err)?;
    let sock = {
        let _enter = ctx.tokio.enter();
        tokio::net::UdpSocket::from_std(sock).map_err(bind_err)?
    };
    let local = sock.local_addr().map_err(bind_err)?;
    let ip = if local.ip().is_unspecified() {
        // No member yet (a pool in DNS not answered): the vserver's own address, the way a
        // wildcard bind is resolved for its other legs.
        let peer = udp_members
            .first()
            .or_else(|| bound.iter().find(|b| !b.ip().is_unspecified()))
            .ok_or_else(|| {
                setup("no sip-udp service yet to choose the UDP leg's address toward; give the vserver `advertise` or bind it to an address".into())
            })?;
        crate::net::local_ip_toward(*peer).map_err(|e| setup(format!("no route to {peer}: {e}")))?
    } else {
        local.ip()
    };
    let leg =
        Local::from_addr(SocketAddr::new(ip, local.port()), Transport::Udp).with_aliases(&[local]);
    Ok((Arc::new(sock), leg))
}
