//! Socket construction (socket2): SO_REUSEPORT worker sockets with large buffers, and
//! IP_FREEBIND for addresses the host does not hold yet. IO.

use socket2::{Domain, Protocol, Socket, Type};
use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::Once;

/// Receive / send buffer asked of the kernel for datagram sockets. SIP bursts (a REGISTER
/// storm after an outage) overflow the default ~200 KiB quickly; the kernel caps the value
/// at net.core.rmem_max, which is fine.
pub(crate) const UDP_BUFFER_BYTES: usize = 4 << 20;

/// How a vserver's listening sockets are set up, beyond their address.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ListenOptions {
    /// IP_FREEBIND / IPV6_FREEBIND: bind an address that is not on the host (yet), such as
    /// the VIP a standby takes over later (docs/deployment.md); packets reach the socket once
    /// the address arrives.
    pub freebind: bool,
}

/// A socket of `ty` for `addr` with the options every listener here shares: IPv6-only for an
/// IPv6 address (a [::] bind must not also take the IPv4 wildcard: the config may bind both),
/// SO_REUSEADDR, SO_REUSEPORT when asked, and `opts`. Not bound yet.
fn listener_socket(
    addr: SocketAddr,
    ty: Type,
    protocol: Protocol,
    reuse_port: bool,
    opts: ListenOptions,
) -> io::Result<Socket> {
    let socket = Socket::new(Domain::for_address(addr), ty, Some(protocol))?;
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    socket.set_reuse_address(true)?;
    if reuse_port {
        socket.set_reuse_port(true)?;
    }
    if opts.freebind {
        if addr.is_ipv6() {
            socket.set_freebind_v6(true)?;
        } else {
            socket.set_freebind_v4(true)?;
        }
    }
    Ok(socket)
}

/// `count` (at least 1) sockets made by `make` on one address with SO_REUSEPORT, of type
/// `ty`: the group is this process's alone. Linux lets a SO_REUSEPORT socket join a port
/// that another process of the same user holds with SO_REUSEPORT (and hands such a port out
/// for port 0), and would then share the traffic between the two processes without a word:
/// a second fulcrum started with the same config, or two vservers on port 0 in different
/// processes. So the address is first bound without SO_REUSEPORT, which conflicts with any
/// holder: a port in use fails with EADDRINUSE, and port 0 resolves to a port nobody holds;
/// the group then binds that port.
fn reuse_port_group(
    addr: SocketAddr,
    count: usize,
    ty: Type,
    protocol: Protocol,
    opts: ListenOptions,
    make: impl Fn(SocketAddr) -> io::Result<Socket>,
) -> io::Result<Vec<Socket>> {
    let bound = {
        let probe = listener_socket(addr, ty, protocol, false, opts)?;
        // Over UDP, SO_REUSEADDR on both sides lets sockets share a port too.
        if ty == Type::DGRAM {
            probe.set_reuse_address(false)?;
        }
        probe.bind(&addr.into())?;
        probe
            .local_addr()?
            .as_socket()
            .ok_or_else(|| io::Error::other("bound socket has no IP address"))?
    };
    let first = make(bound)?;
    let mut out = vec![first];
    for _ in 1..count.max(1) {
        out.push(make(bound)?);
    }
    Ok(out)
}

fn udp_socket(addr: SocketAddr, opts: ListenOptions) -> io::Result<Socket> {
    let socket = listener_socket(addr, Type::DGRAM, Protocol::UDP, true, opts)?;
    // Best effort: the socket works with the default buffers, only bursts overflow sooner
    // (the kernel caps a large value at net.core.rmem_max / wmem_max without an error).
    if let Err(e) = socket.set_recv_buffer_size(UDP_BUFFER_BYTES) {
        warn_buffer_once("SO_RCVBUF", &e);
    }
    if let Err(e) = socket.set_send_buffer_size(UDP_BUFFER_BYTES) {
        warn_buffer_once("SO_SNDBUF", &e);
    }
    socket.bind(&addr.into())?;
    Ok(socket)
}

/// Logs a failure to size a datagram socket's buffers once per process: every worker socket
/// of every vserver would fail alike, and one line says what the operator needs to know.
fn warn_buffer_once(option: &str, error: &io::Error) {
    static WARNED: Once = Once::new();
    WARNED.call_once(|| {
        tracing::warn!(
            option,
            bytes = UDP_BUFFER_BYTES,
            %error,
            "cannot set the UDP socket buffer size; keeping the system default (logged once)"
        );
    });
}

/// `count` UDP sockets bound to the same address with SO_REUSEPORT, so each worker owns
/// one and the kernel keeps every flow (4-tuple) on one socket: messages of one call are
/// never reordered between workers. Port 0 is resolved by the first bind and reused.
pub(crate) fn bind_udp_workers(
    addr: SocketAddr,
    count: usize,
    opts: ListenOptions,
) -> io::Result<Vec<UdpSocket>> {
    Ok(
        reuse_port_group(addr, count, Type::DGRAM, Protocol::UDP, opts, |a| {
            udp_socket(a, opts)
        })?
        .into_iter()
        .map(UdpSocket::from)
        .collect(),
    )
}

fn tcp_listener(addr: SocketAddr, reuse_port: bool, opts: ListenOptions) -> io::Result<Socket> {
    let socket = listener_socket(addr, Type::STREAM, Protocol::TCP, reuse_port, opts)?;
    // Accepted connections inherit TCP_NODELAY from their listener (Linux): one system call
    // here instead of one per connection. Set before `listen`, so that no connection is
    // accepted without it. A proxy forwards each read at once; Nagle would hold a small
    // second write until the first is acknowledged.
    socket.set_tcp_nodelay(true)?;
    socket.bind(&addr.into())?;
    // Bursts of short connections (HTTP with `Connection: close`) must not be dropped by
    // the kernel before the accept loop runs; the kernel caps it at somaxconn.
    socket.listen(4096)?;
    socket.set_nonblocking(true)?;
    Ok(socket)
}

/// A TCP listener (SO_REUSEADDR, IPv6-only for [::] binds), non-blocking for tokio.
pub(crate) fn bind_tcp_listener(
    addr: SocketAddr,
    opts: ListenOptions,
) -> io::Result<std::net::TcpListener> {
    tcp_listener(addr, false, opts).map(Into::into)
}

/// `count` TCP listeners on the same address with SO_REUSEPORT, one per worker thread: the
/// kernel spreads incoming connections over them, and each connection lives on the thread
/// that accepted it. Port 0 is resolved by the first bind and reused.
pub(crate) fn bind_tcp_workers(
    addr: SocketAddr,
    count: usize,
    opts: ListenOptions,
) -> io::Result<Vec<std::net::TcpListener>> {
    Ok(
        reuse_port_group(addr, count, Type::STREAM, Protocol::TCP, opts, |a| {
            tcp_listener(a, true, opts)
        })?
        .into_iter()
        .map(Into::into)
        .collect(),
    )
}

/// Number of worker sockets for `configured` (0 = one per core).
pub(crate) fn worker_count(configured: usize) -> usize {
    if configured > 0 {
        configured
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }
}

/// The local address the kernel would use to reach `peer` (for Via when bound to a
/// wildcard without `advertise`).
pub(crate) fn local_ip_toward(peer: SocketAddr) -> io::Result<std::net::IpAddr> {
    let any: SocketAddr = if peer.is_ipv4() {
        "0.0.0.0:0".parse().map_err(io::Error::other)?
    } else {
        "[::]:0".parse().map_err(io::Error::other)?
    };
    let s = UdpSocket::bind(any)?;
    s.connect(peer)?;
    Ok(s.local_addr()?.ip())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_share_one_port() {
        let socks = bind_udp_workers(
            "127.0.0.1:0".parse().expect("addr"),
            3,
            ListenOptions::default(),
        )
        .expect("bind");
        assert_eq!(socks.len(), 3);
        let port = socks[0].local_addr().expect("addr").port();
        assert_ne!(port, 0);
        assert!(
            socks
                .iter()
                .all(|s| s.local_addr().expect("addr").port() == port)
        );
    }

    /// A port another process's SO_REUSEPORT group holds is not joined: refused as in use,
    /// over UDP and TCP. (A socket of this process stands for the other process: the kernel
    /// lets any SO_REUSEPORT socket of the same user join.) And port 0 never resolves to such
    /// a port: many groups on port 0 beside many foreign reuse-port sockets (the kernel hands
    /// their ports out again for port 0: thousands of times in 20,000 binds here) get ports
    /// of their own.
    #[test]
    fn a_worker_group_never_shares_its_port_with_another_reuse_port_socket() {
        let foreign = |ty: Type, protocol: Protocol| {
            let s = listener_socket(
                "127.0.0.1:0".parse().expect("addr"),
                ty,
                protocol,
                true,
                ListenOptions::default(),
            )
            .expect("socket");
            s.bind(&"127.0.0.1:0".parse::<SocketAddr>().expect("addr").into())
                .expect("bind");
            if ty == Type::STREAM {
                s.listen(16).expect("listen");
            }
            s
        };
        let port = |s: &Socket| {
            s.local_addr()
                .expect("addr")
                .as_socket()
                .expect("ip")
                .port()
        };
        let udp = foreign(Type::DGRAM, Protocol::UDP);
        let at = SocketAddr::from(([127, 0, 0, 1], port(&udp)));
        let e = bind_udp_workers(at, 2, ListenOptions::default()).expect_err("taken");
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse, "{e}");
        let tcp = foreign(Type::STREAM, Protocol::TCP);
        let at = SocketAddr::from(([127, 0, 0, 1], port(&tcp)));
        let e = bind_tcp_workers(at, 2, ListenOptions::default()).expect_err("taken");
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse, "{e}");
        // Port 0 beside 1,000 foreign reuse-port UDP sockets: 200 groups, no port shared.
        let held: Vec<Socket> = (0..1000)
            .map(|_| foreign(Type::DGRAM, Protocol::UDP))
            .collect();
        let others: std::collections::HashSet<u16> = held.iter().map(port).collect();
        let mut mine = std::collections::HashSet::new();
        let mut groups = Vec::new();
        for _ in 0..200 {
            let g = bind_udp_workers(
                "127.0.0.1:0".parse().expect("addr"),
                2,
                ListenOptions::default(),
            )
            .expect("bind");
            let p = g[0].local_addr().expect("addr").port();
            assert!(!others.contains(&p), "port {p} joined a foreign group");
            assert!(mine.insert(p), "port {p} given to two groups");
            groups.push(g);
        }
    }

    #[test]
    fn tcp_workers_share_one_port_and_the_connections() {
        let ls = bind_tcp_workers(
            "127.0.0.1:0".parse().expect("addr"),
            2,
            ListenOptions::default(),
        )
        .expect("bind");
        assert_eq!(ls.len(), 2);
        let addr = ls[0].local_addr().expect("addr");
        assert_ne!(addr.port(), 0);
        assert_eq!(ls[1].local_addr().expect("addr"), addr);
        // The kernel hashes each connection's 4-tuple to one listener: over 64 connections
        // both get some (the chance that one gets none is 2^-63).
        let clients: Vec<_> = (0..64)
            .map(|_| std::net::TcpStream::connect(addr).expect("connect"))
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(100));
        let mut got = [0usize; 2];
        for (i, l) in ls.iter().enumerate() {
            while let Ok((c, _)) = l.accept() {
                got[i] += 1;
                assert!(c.nodelay().expect("nodelay"), "inherited from the listener");
            }
        }
        assert_eq!(got[0] + got[1], clients.len());
        assert!(got[0] > 0 && got[1] > 0, "{got:?}");
    }

    /// 192.0.2.1 is TEST-NET-1 (RFC 5737), on no host: binding it needs IP_FREEBIND. Nothing
    /// is sent from the sockets.
    #[test]
    fn freebind_binds_an_address_the_host_does_not_hold() {
        let addr: SocketAddr = "192.0.2.1:0".parse().expect("addr");
        let free = ListenOptions { freebind: true };
        let udp = bind_udp_workers(addr, 2, free).expect("udp with freebind");
        assert_eq!(udp[0].local_addr().expect("addr").ip(), addr.ip());
        let tcp = bind_tcp_listener(addr, free).expect("tcp with freebind");
        assert_eq!(tcp.local_addr().expect("addr").ip(), addr.ip());
        if nonlocal_bind_allowed() {
            return;
        }
        let strict = ListenOptions::default();
        for e in [
            bind_udp_workers(addr, 1, strict).map(drop),
            bind_tcp_workers(addr, 1, strict).map(drop),
        ] {
            let e = e.expect_err("not on this host");
            assert_eq!(e.kind(), io::ErrorKind::AddrNotAvailable, "{e}");
        }
    }

    /// net.ipv4.ip_nonlocal_bind = 1 lets every socket bind any address, as freebind does
    /// for one.
    fn nonlocal_bind_allowed() -> bool {
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_nonlocal_bind")
            .is_ok_and(|v| v.trim() != "0")
    }

    #[test]
    fn local_ip_toward_loopback() {
        let ip = local_ip_toward("127.0.0.1:9".parse().expect("addr")).expect("route");
        assert!(ip.is_loopback());
    }
}

/// `recv_from` on a blocking UDP socket that a shutdown may wake with `shutdown(SHUT_RD)`:
/// Linux then returns 0 bytes and no sender address, which std's `UdpSocket::recv_from`
/// asserts against (a panic in the worker). `None`: no sender, the wake-up.
pub(crate) fn recv_from(
    socket: &UdpSocket,
    buf: &mut [u8],
) -> io::Result<(usize, Option<SocketAddr>)> {
    use nix::sys::socket::{SockaddrStorage, recvfrom};
    let (n, from) = recvfrom::<SockaddrStorage>(socket.as_raw_fd(), buf)?;
    let addr = from.and_then(|a| {
        if let Some(v4) = a.as_sockaddr_in() {
            Some(SocketAddr::V4((*v4).into()))
        } else {
            a.as_sockaddr_in6().map(|v6| SocketAddr::V6((*v6).into()))
        }
    });
    Ok((n, addr))
}

#[cfg(test)]
mod recv_tests {
    use super::*;

    /// A socket that has received, then is shut for reading (the shutdown's wake-up): the
    /// next receive returns without a sender instead of panicking in std's address decoding.
    #[test]
    fn a_receive_after_shut_rd_has_no_sender_and_does_not_panic() {
        let s = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let c = UdpSocket::bind("127.0.0.1:0").expect("bind");
        c.send_to(b"x", s.local_addr().expect("addr"))
            .expect("send");
        let mut buf = [0u8; 16];
        let (n, from) = recv_from(&s, &mut buf).expect("datagram");
        assert_eq!((n, from), (1, Some(c.local_addr().expect("addr"))));
        // Linux answers ENOTCONN on an unconnected UDP socket, and shuts it for reading.
        let _ = socket2::SockRef::from(&s).shutdown(std::net::Shutdown::Read);
        match recv_from(&s, &mut buf) {
            Ok((0, None)) | Err(_) => {}
            other => panic!("{other:?}"),
        }
    }
}

/// Ask the kernel to report, with each datagram `socket` receives, the local address it was
/// sent to (IP_PKTINFO / IPV6_RECVPKTINFO): what a wildcard socket cannot tell otherwise.
pub(crate) fn set_pktinfo(socket: &UdpSocket) -> io::Result<()> {
    use nix::sys::socket::{setsockopt, sockopt};
    let r = if socket.local_addr()?.is_ipv4() {
        setsockopt(socket, sockopt::Ipv4PacketInfo, &true)
    } else {
        setsockopt(socket, sockopt::Ipv6RecvPacketInfo, &true)
    };
    r.map_err(io::Error::from)
}

/// Room for one packet-info control message of either family.
pub(crate) fn pktinfo_buffer() -> Vec<u8> {
    nix::cmsg_space!(nix::libc::in6_pktinfo)
}

/// As [`recv_from`], and the local address the datagram was sent to: from the packet info
/// when `socket` has [`set_pktinfo`] (`cmsg` from [`pktinfo_buffer`]), else `bound`.
#[expect(
    clippy::ptr_arg,
    reason = "nix's recvmsg takes the control buffer as a Vec"
)]
pub(crate) fn recv_with_local(
    socket: &UdpSocket,
    buf: &mut [u8],
    cmsg: &mut Vec<u8>,
    bound: SocketAddr,
) -> io::Result<(usize, Option<SocketAddr>, SocketAddr)> {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, SockaddrStorage, recvmsg};
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let mut iov = [io::IoSliceMut::new(buf)];
    let msg =
        recvmsg::<SockaddrStorage>(socket.as_raw_fd(), &mut iov, Some(cmsg), MsgFlags::empty())?;
    let mut local = bound;
    if let Ok(cmsgs) = msg.cmsgs() {
        for c in cmsgs {
            match c {
                ControlMessageOwned::Ipv4PacketInfo(pi) => {
                    let ip = Ipv4Addr::from(u32::from_be(pi.ipi_addr.s_addr));
                    local = SocketAddr::new(IpAddr::V4(ip), bound.port());
                }
                ControlMessageOwned::Ipv6PacketInfo(pi) => {
                    let ip = Ipv6Addr::from(pi.ipi6_addr.s6_addr);
                    local = SocketAddr::new(IpAddr::V6(ip), bound.port());
                }
                _ => {}
            }
        }
    }
    let from = msg.address.and_then(|a| {
        if let Some(v4) = a.as_sockaddr_in() {
            Some(SocketAddr::V4((*v4).into()))
        } else {
            a.as_sockaddr_in6().map(|v6| SocketAddr::V6((*v6).into()))
        }
    });
    Ok((msg.bytes, from, local))
}

/// Send `bytes` to `to` from `socket`, naming `from` as the source address when given
/// (IP_PKTINFO's `ipi_spec_dst`, IPV6_PKTINFO's `ipi6_addr`; the port stays the socket's);
/// `dontwait`: MSG_DONTWAIT.
pub(crate) fn send_from(
    socket: &UdpSocket,
    bytes: &[u8],
    to: SocketAddr,
    from: Option<std::net::IpAddr>,
    dontwait: bool,
) -> io::Result<usize> {
    use nix::sys::socket::{ControlMessage, MsgFlags, SockaddrStorage, sendmsg};
    use std::net::IpAddr;
    let flags = if dontwait {
        MsgFlags::MSG_DONTWAIT
    } else {
        MsgFlags::empty()
    };
    let Some(from) = from else {
        return socket2::SockRef::from(socket).send_to_with_flags(bytes, &to.into(), flags.bits());
    };
    let iov = [io::IoSlice::new(bytes)];
    let dest = SockaddrStorage::from(to);
    let sent = match from {
        IpAddr::V4(ip) => {
            let pi = nix::libc::in_pktinfo {
                ipi_ifindex: 0,
                ipi_spec_dst: nix::libc::in_addr {
                    s_addr: u32::from(ip).to_be(),
                },
                ipi_addr: nix::libc::in_addr { s_addr: 0 },
            };
            sendmsg(
                socket.as_raw_fd(),
                &iov,
                &[ControlMessage::Ipv4PacketInfo(&pi)],
                flags,
                Some(&dest),
            )
        }
        IpAddr::V6(ip) => {
            let pi = nix::libc::in6_pktinfo {
                ipi6_addr: nix::libc::in6_addr {
                    s6_addr: ip.octets(),
                },
                ipi6_ifindex: 0,
            };
            sendmsg(
                socket.as_raw_fd(),
                &iov,
                &[ControlMessage::Ipv6PacketInfo(&pi)],
                flags,
                Some(&dest),
            )
        }
    };
    sent.map_err(io::Error::from)
}

#[cfg(test)]
mod pktinfo_tests {
    use super::*;

    /// A wildcard socket learns which of the host's addresses a datagram was sent to, and
    /// answers from it when asked: 127.0.0.1 and 127.0.0.2 are both this host's.
    #[test]
    fn a_wildcard_socket_answers_from_the_address_it_was_sent_to() {
        let s = UdpSocket::bind("0.0.0.0:0").expect("bind");
        set_pktinfo(&s).expect("pktinfo");
        let port = s.local_addr().expect("addr").port();
        let c = UdpSocket::bind("127.0.0.1:0").expect("bind");
        c.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .expect("timeout");
        let mut cmsg = pktinfo_buffer();
        let mut buf = [0u8; 64];
        for target in ["127.0.0.2", "127.0.0.1"] {
            let to: SocketAddr = format!("{target}:{port}").parse().expect("addr");
            c.send_to(b"ping", to).expect("send");
            let (n, from, local) =
                recv_with_local(&s, &mut buf, &mut cmsg, s.local_addr().expect("addr"))
                    .expect("receive");
            assert_eq!((n, from), (4, Some(c.local_addr().expect("addr"))));
            assert_eq!(local, to, "the address the client sent to");
            let from = from.expect("sender");
            send_from(&s, b"pong", from, Some(local.ip()), false).expect("send");
            let (n, src) = c.recv_from(&mut buf).expect("answer");
            assert_eq!((n, src), (4, to), "the answer leaves from {to}");
        }
    }
}
