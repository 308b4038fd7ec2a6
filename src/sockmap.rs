//! The in-kernel relay of TCP connections: once fulcrum has chosen a connection's service,
//! the kernel moves its bytes socket to socket, and user space only owns the sockets (idle
//! timeout, drain, half-close, close). IO; the one module besides `uring.rs` and `memory.rs`
//! allowed `unsafe` (the `bpf(2)` system call takes its arguments by address).
//!
//! # How
//! A BPF sockmap holds both sockets of each relayed connection, the client's and the
//! service's, in two slots; a hash map gives each socket (by its socket cookie, which the
//! kernel never reuses while the socket lives) the slot of its peer. A `sk_skb` verdict
//! program (`BPF_SK_SKB_VERDICT`, Linux 5.13 or later), attached to the sockmap, runs on every
//! segment a socket in the map receives and redirects it to the egress of the peer's
//! socket: the bytes never reach user space. The program is twenty-four instructions,
//! encoded below ([`PROGRAM`]), so no eBPF toolchain is needed to build fulcrum:
//!
//! ```text
//!  0: r6 = r1                         ; the segment
//!  1: r2 = *(u32 *)(r1 + 0)           ; its length
//!  2: if r2 == 0 goto 22              ; a FIN alone: kept (see below)
//!  3: call get_socket_cookie          ; r0 = the receiving socket's cookie
//!  4: *(u64 *)(r10 - 8) = r0
//!  5: r1 = peers map                  ; (two instructions: a 64-bit immediate)
//!  7: r2 = r10
//!  8: r2 += -8
//!  9: call map_lookup_elem            ; r0 = &{peer slot, kept}, or NULL
//! 10: if r0 == 0 goto 22              ; not ours: left where it is
//! 11: r7 = r0
//! 12: r3 = *(u32 *)(r0 + 4)
//! 13: if r3 != 0 goto 22              ; this socket's bytes stay in user space
//! 14: r3 = *(u32 *)(r0 + 0)
//! 15: r1 = r6
//! 16: r2 = sockmap                    ; (two instructions)
//! 18: r4 = 0                          ; to the peer's egress
//! 19: call sk_redirect_map            ; marks the segment for the peer, or fails
//! 20: if r0 == SK_PASS goto 22        ; marked
//! 21: *(u32 *)(r7 + 4) = 1            ; failed: this and every later segment kept
//! 22: r0 = SK_PASS                    ; redirected if marked; else kept by this socket,
//! 23: exit                            ;   where user space reads it (never dropped)
//! ```
//!
//! A segment of no bytes is a FIN that arrived alone. Redirected, it would reach the peer's
//! send path as a send of nothing, which the kernel takes for a broken pipe: it reports
//! `EPIPE` on the peer's socket and stops relaying to it (measured on Linux 6.18; the
//! module's tests keep the case). Kept, it reads as end of file on the socket that got it,
//! as a FIN that came with data does.
//!
//! # The hand-over ([`Relay::splice`])
//! 1. Bytes user space has read and not yet written (a PROXY header, a request head it
//!    parsed) are written to their peer before the sockets enter the map, by the caller.
//! 2. The peer entries go in first, then the service's socket, then the client's. A socket
//!    in the map gets a verdict on every segment the moment it arrives, so the two sockets
//!    cannot enter at once: a segment the service's socket receives in the moment before
//!    the client's is in (a quick answer to the bytes of step 1) finds no peer to go to.
//!    The program keeps it on that socket, where the owner reads it and writes it on, and
//!    marks the socket (`kept`) so that every later segment of that direction is kept too:
//!    were they redirected, they could overtake it. That direction then stays in user
//!    space for the rest of the connection (the owner counts it); the other stays in the
//!    kernel.
//! 3. Bytes that arrived before a socket entered the map are in its receive queue, which
//!    the verdict program sees only when the next segment arrives (and which `recv` can no
//!    longer read). Setting `SO_RCVLOWAT` runs the socket's data-ready path at once
//!    (`tcp_set_rcvlowat`), so they are relayed now, in order, ahead of anything later.
//! 4. Only established sockets enter a sockmap. A service socket that is not leaves nothing
//!    behind (it goes first); a client socket that is not (its FIN came with its request)
//!    leaves the pair with the service's socket alone in the map: everything it receives is
//!    kept (no peer), and the owner relays both directions in user space.
//!
//! After that, a FIN reaches user space as end of file on the socket that got it (after
//! every byte before it was relayed); the owner then shuts down the peer's write side, as
//! the user-space relay does. A reset reads as an error. [`Pair`] takes both sockets out of
//! the map when it is dropped; closing a socket also removes it.

#![allow(unsafe_code)]

use nix::libc;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_ATTACH: libc::c_long = 8;
const BPF_MAP_TYPE_HASH: u32 = 1;
const BPF_MAP_TYPE_SOCKMAP: u32 = 15;
const BPF_PROG_TYPE_SK_SKB: u32 = 14;
const BPF_SK_SKB_VERDICT: u32 = 38;
const SO_COOKIE: libc::c_int = 57;
const BPF_F_NO_PREALLOC: u32 = 1;
// `tcpi_state` values (include/net/tcp_states.h).
const TCP_TIME_WAIT: u8 = 6;
const TCP_CLOSE: u8 = 7;
const TCP_CLOSE_WAIT: u8 = 8;
const TCP_LAST_ACK: u8 = 9;
const TCP_CLOSING: u8 = 11;

/// One BPF instruction: opcode, registers (source in the high nibble), offset, immediate.
const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> [u8; 8] {
    let o = off.to_le_bytes();
    let i = imm.to_le_bytes();
    [code, (src << 4) | dst, o[0], o[1], i[0], i[1], i[2], i[3]]
}

const MOV64_REG: u8 = 0xbf;
const MOV64_IMM: u8 = 0xb7;
const ADD64_IMM: u8 = 0x07;
const CALL: u8 = 0x85;
const EXIT: u8 = 0x95;
const STX_DW: u8 = 0x7b;
const LDX_W: u8 = 0x61;
const JEQ_IMM: u8 = 0x15;
const JNE_IMM: u8 = 0x55;
const ST_W: u8 = 0x62;
const LD_IMM64: u8 = 0x18;
/// `src` of an `LD_IMM64` whose immediate is a map's file descriptor.
const PSEUDO_MAP_FD: u8 = 1;
const HELPER_MAP_LOOKUP_ELEM: i32 = 1;
const HELPER_GET_SOCKET_COOKIE: i32 = 46;
const HELPER_SK_REDIRECT_MAP: i32 = 52;
const SK_PASS: i32 = 1;

/// The verdict program, with the two map descriptors at instructions 5 and 16 patched in
/// by [`program`].
const PROGRAM: [[u8; 8]; 24] = [
    insn(MOV64_REG, 6, 1, 0, 0),
    insn(LDX_W, 2, 1, 0, 0),
    insn(JEQ_IMM, 2, 0, 19, 0),
    insn(CALL, 0, 0, 0, HELPER_GET_SOCKET_COOKIE),
    insn(STX_DW, 10, 0, -8, 0),
    insn(LD_IMM64, 1, PSEUDO_MAP_FD, 0, 0),
    insn(0, 0, 0, 0, 0),
    insn(MOV64_REG, 2, 10, 0, 0),
    insn(ADD64_IMM, 2, 0, 0, -8),
    insn(CALL, 0, 0, 0, HELPER_MAP_LOOKUP_ELEM),
    insn(JEQ_IMM, 0, 0, 11, 0),
    insn(MOV64_REG, 7, 0, 0, 0),
    insn(LDX_W, 3, 0, 4, 0),
    insn(JNE_IMM, 3, 0, 8, 0),
    insn(LDX_W, 3, 0, 0, 0),
    insn(MOV64_REG, 1, 6, 0, 0),
    insn(LD_IMM64, 2, PSEUDO_MAP_FD, 0, 0),
    insn(0, 0, 0, 0, 0),
    insn(MOV64_IMM, 4, 0, 0, 0),
    insn(CALL, 0, 0, 0, HELPER_SK_REDIRECT_MAP),
    insn(JEQ_IMM, 0, 0, 1, SK_PASS),
    insn(ST_W, 7, 0, 4, 1),
    insn(MOV64_IMM, 0, 0, 0, SK_PASS),
    insn(EXIT, 0, 0, 0, 0),
];

fn program(peers: RawFd, sockmap: RawFd) -> Vec<u8> {
    let mut p = PROGRAM;
    p[5] = insn(LD_IMM64, 1, PSEUDO_MAP_FD, 0, peers);
    p[16] = insn(LD_IMM64, 2, PSEUDO_MAP_FD, 0, sockmap);
    p.concat()
}

/// `bpf(cmd, attr)`: a new descriptor (or 0) on success.
fn bpf(cmd: libc::c_long, attr: &mut [u8; 128]) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a live, writable 128-byte buffer, the size passed; every pointer
    // stored in it by the callers points to memory that outlives this call.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), attr.len()) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn put(attr: &mut [u8; 128], at: usize, bytes: &[u8]) {
    attr[at..at + bytes.len()].copy_from_slice(bytes);
}

fn owned(fd: libc::c_long) -> io::Result<OwnedFd> {
    let fd = RawFd::try_from(fd).map_err(|_| io::Error::other("descriptor out of range"))?;
    // SAFETY: the kernel just returned `fd`, a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn map_create(kind: u32, key: u32, value: u32, entries: u32) -> io::Result<OwnedFd> {
    let mut a = [0u8; 128];
    put(&mut a, 0, &kind.to_ne_bytes());
    put(&mut a, 4, &key.to_ne_bytes());
    put(&mut a, 8, &value.to_ne_bytes());
    put(&mut a, 12, &entries.to_ne_bytes());
    if kind == BPF_MAP_TYPE_HASH {
        // Entries allocated as connections come, not all at creation.
        put(&mut a, 16, &BPF_F_NO_PREALLOC.to_ne_bytes());
    }
    owned(bpf(BPF_MAP_CREATE, &mut a)?)
}

/// The attributes naming element `key` of `map` (the key by address).
fn elem(map: &OwnedFd, key: &[u8]) -> [u8; 128] {
    let mut a = [0u8; 128];
    put(&mut a, 0, &map.as_raw_fd().to_ne_bytes());
    put(&mut a, 8, &(key.as_ptr() as u64).to_ne_bytes());
    a
}

fn map_update(map: &OwnedFd, key: &[u8], value: &[u8]) -> io::Result<()> {
    let mut a = elem(map, key);
    put(&mut a, 16, &(value.as_ptr() as u64).to_ne_bytes());
    bpf(BPF_MAP_UPDATE_ELEM, &mut a).map(drop)
}

fn map_delete(map: &OwnedFd, key: &[u8]) -> io::Result<()> {
    bpf(BPF_MAP_DELETE_ELEM, &mut elem(map, key)).map(drop)
}

/// The socket's cookie (`SO_COOKIE`): unique while it lives.
fn cookie(fd: RawFd) -> io::Result<u64> {
    let mut c: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: `c` and `len` are live locals of the sizes given.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            SO_COOKIE,
            (&raw mut c).cast(),
            &raw mut len,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(c)
}

/// Run the socket's data-ready path: bytes queued before it entered the map are relayed.
fn kick(fd: RawFd) -> io::Result<()> {
    let one: libc::c_int = 1;
    // SAFETY: `one` is a live local of the size given.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&raw const one).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// What the kernel says of a relayed socket (`TCP_INFO` and the send queue).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Flow {
    /// Bytes received from the peer and taken from the receive queue (read by user space
    /// or moved by the relay), all told; a FIN is not counted.
    pub received: u64,
    /// Bytes written into the socket, all told: acknowledged by the peer, or still queued.
    pub written: u64,
    /// Milliseconds since the socket last received data.
    pub idle_ms: u32,
}

/// [`Flow`] of the TCP socket `fd`.
pub fn flow(fd: RawFd) -> io::Result<Flow> {
    // SAFETY: `tcp_info` is plain data; all zeros is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` and `len` are live locals of the sizes given.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast(),
            &raw mut len,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut queued: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (SIOCOUTQ) writes one int, `queued`.
    let r = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &raw mut queued) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut unread: libc::c_int = 0;
    // SAFETY: FIONREAD (SIOCINQ) writes one int, `unread`.
    let r = unsafe { libc::ioctl(fd, libc::FIONREAD, &raw mut unread) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // `tcpi_bytes_received` counts a FIN's sequence number once it came: not a byte. States
    // after a FIN came in (a reset also ends in TCP_CLOSE: then one byte too few is counted).
    let fin = matches!(
        info.tcpi_state,
        TCP_CLOSE_WAIT | TCP_LAST_ACK | TCP_CLOSING | TCP_TIME_WAIT | TCP_CLOSE
    );
    Ok(Flow {
        received: info
            .tcpi_bytes_received
            .saturating_sub(u64::try_from(unread).unwrap_or(0))
            .saturating_sub(u64::from(fin)),
        written: info
            .tcpi_bytes_acked
            .saturating_add(u64::try_from(queued).unwrap_or(0)),
        idle_ms: info.tcpi_last_data_recv,
    })
}

/// The sockmap, the peer map and the attached verdict program; room for `capacity` relayed
/// connections (two slots each).
pub struct Relay {
    sockmap: OwnedFd,
    peers: OwnedFd,
    _prog: OwnedFd,
    /// Free pair indices (pair `i` has slots `2i` and `2i + 1`).
    free: Mutex<Vec<u32>>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay").finish_non_exhaustive()
    }
}

impl Relay {
    /// Create the maps, load the program and attach it. Fails where the kernel refuses any
    /// of it (no BPF, no permission, a kernel before 5.13): the caller keeps the user-space
    /// relay and says why.
    pub fn new(capacity: u32) -> io::Result<Arc<Relay>> {
        let slots = capacity
            .checked_mul(2)
            .filter(|&s| s > 0)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "capacity out of range"))?;
        let sockmap = map_create(BPF_MAP_TYPE_SOCKMAP, 4, 4, slots)?;
        // Cookie -> {the peer's slot, kept} (two u32s).
        let peers = map_create(BPF_MAP_TYPE_HASH, 8, 8, slots)?;
        let code = program(peers.as_raw_fd(), sockmap.as_raw_fd());
        let license = b"GPL\0";
        let mut a = [0u8; 128];
        put(&mut a, 0, &BPF_PROG_TYPE_SK_SKB.to_ne_bytes());
        put(&mut a, 4, &((code.len() / 8) as u32).to_ne_bytes());
        put(&mut a, 8, &(code.as_ptr() as u64).to_ne_bytes());
        put(&mut a, 16, &(license.as_ptr() as u64).to_ne_bytes());
        put(&mut a, 48, b"fulcrum_relay\0");
        let prog = owned(bpf(BPF_PROG_LOAD, &mut a)?)?;
        let mut a = [0u8; 128];
        put(&mut a, 0, &sockmap.as_raw_fd().to_ne_bytes());
        put(&mut a, 4, &prog.as_raw_fd().to_ne_bytes());
        put(&mut a, 8, &BPF_SK_SKB_VERDICT.to_ne_bytes());
        bpf(BPF_PROG_ATTACH, &mut a)?;
        Ok(Arc::new(Relay {
            sockmap,
            peers,
            _prog: prog,
            free: Mutex::new((0..capacity).rev().collect()),
        }))
    }

    /// Relay `a` and `b` (connected TCP sockets) to each other in the kernel from now on
    /// (see the module doc for the hand-over). `None` when every slot is taken; an error
    /// (`EOPNOTSUPP` when `b` is no longer established) leaves nothing in the map. A pair
    /// whose `a` could not enter relays nothing in the kernel: its owner copies both ways.
    pub fn splice(self: &Arc<Self>, a: RawFd, b: RawFd) -> io::Result<Option<Pair>> {
        self.splice_with(a, b, || {})
    }

    /// [`Relay::splice`], running `between` after `b` went into the map and before `a` does
    /// (the tests' way into the moment of step 2 in the module doc).
    fn splice_with(
        self: &Arc<Self>,
        a: RawFd,
        b: RawFd,
        between: impl FnOnce(),
    ) -> io::Result<Option<Pair>> {
        let Some(pair) = crate::sync::lock(&self.free).pop() else {
            return Ok(None);
        };
        let cookies = match (cookie(a), cookie(b)) {
            (Ok(ca), Ok(cb)) => [ca, cb],
            (Err(e), _) | (_, Err(e)) => {
                crate::sync::lock(&self.free).push(pair);
                return Err(e);
            }
        };
        // From here a failure drops `p`, which clears whatever went in.
        let p = Pair {
            relay: Arc::clone(self),
            pair,
            cookies,
        };
        let [ca, cb] = cookies;
        let (sa, sb) = (2 * pair, 2 * pair + 1);
        let entry = |slot: u32| {
            let mut v = [0u8; 8];
            v[..4].copy_from_slice(&slot.to_ne_bytes());
            v
        };
        map_update(&self.peers, &ca.to_ne_bytes(), &entry(sb))?;
        map_update(&self.peers, &cb.to_ne_bytes(), &entry(sa))?;
        // `b` first: a segment `a` receives once `a` is in finds `b` there. (The caller
        // passes as `a` the side that speaks first, the client.)
        map_update(&self.sockmap, &sb.to_ne_bytes(), &b.to_ne_bytes())?;
        between();
        match map_update(&self.sockmap, &sa.to_ne_bytes(), &a.to_ne_bytes()) {
            Ok(()) => kick(a)?,
            // `a` is no longer established (its FIN came: only established sockets enter a
            // sockmap). `b` stays in: taking it out would drop what it kept meanwhile (a
            // socket leaving the map loses its kept segments). With no peer in the map,
            // every segment `b` receives is kept for user space, and `a` is a plain socket:
            // the owner relays both directions itself, in order.
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {}
            Err(e) => return Err(e),
        }
        kick(b)?;
        Ok(Some(p))
    }

    /// Whether the relay works here: a loopback client and server, spliced through two
    /// proxy-side sockets, exchange bytes both ways (some queued before the splice), and a
    /// FIN reaches the proxy side after the bytes before it. What `kernel_relay: auto`
    /// checks at start.
    pub fn self_test(self: &Arc<Self>) -> io::Result<()> {
        use std::io::{Read, Write};
        use std::net::Shutdown;
        let Loopback {
            mut client,
            front,
            back,
            mut server,
        } = Loopback::new()?;
        let early = b"queued before the splice;";
        client.write_all(early)?;
        let pair = self
            .splice(front.as_raw_fd(), back.as_raw_fd())?
            .ok_or_else(|| io::Error::other("no free slot"))?;
        let late = vec![7u8; 256 * 1024];
        client.write_all(&late)?;
        let mut got = vec![0u8; early.len() + late.len()];
        server.read_exact(&mut got)?;
        if got[..early.len()] != early[..] || got[early.len()..] != late[..] {
            return Err(io::Error::other("bytes relayed out of order or altered"));
        }
        server.write_all(b"answer")?;
        let mut answer = [0u8; 6];
        client.read_exact(&mut answer)?;
        if &answer != b"answer" {
            return Err(io::Error::other("the answer was altered"));
        }
        client.shutdown(Shutdown::Write)?;
        let mut rest = [0u8; 16];
        if (&front).read(&mut rest)? != 0 {
            return Err(io::Error::other("bytes reached user space"));
        }
        // That FIN came alone (every byte before it long relayed): the peer must not have
        // been told of a broken pipe.
        if let Some(e) = back.take_error()? {
            return Err(io::Error::other(format!(
                "a FIN left an error on its peer: {e}"
            )));
        }
        drop(pair);
        Ok(())
    }
}

/// Two connected loopback TCP pairs, as a proxy sits between them: `client` to `front`
/// (the proxy's client side) and `back` (the proxy's service side) to `server`; reads time
/// out after 2 s. What the self-test and the tests splice.
struct Loopback {
    client: std::net::TcpStream,
    front: std::net::TcpStream,
    back: std::net::TcpStream,
    server: std::net::TcpStream,
}

impl Loopback {
    fn new() -> io::Result<Loopback> {
        use std::net::{TcpListener, TcpStream};
        let l = TcpListener::bind("127.0.0.1:0")?;
        let at = l.local_addr()?;
        let client = TcpStream::connect(at)?;
        let (front, _) = l.accept()?;
        let back = TcpStream::connect(at)?;
        let (server, _) = l.accept()?;
        let timeout = Some(std::time::Duration::from_secs(2));
        for s in [&client, &front, &back, &server] {
            s.set_read_timeout(timeout)?;
        }
        Ok(Loopback {
            client,
            front,
            back,
            server,
        })
    }
}

/// Two sockets relayed by the kernel; dropped, they leave the maps (their owner closes or
/// goes on with them).
pub struct Pair {
    relay: Arc<Relay>,
    pair: u32,
    cookies: [u64; 2],
}

impl std::fmt::Debug for Pair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pair").field("pair", &self.pair).finish()
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        let r = &self.relay;
        for slot in [2 * self.pair, 2 * self.pair + 1] {
            let _ = map_delete(&r.sockmap, &slot.to_ne_bytes());
        }
        for c in &self.cookies {
            let _ = map_delete(&r.peers, &c.to_ne_bytes());
        }
        crate::sync::lock(&r.free).push(self.pair);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where BPF is not permitted (an unprivileged test run) the relay cannot start: that
    /// is the fallback's case, tested by the callers; here the relay itself when it can.
    fn relay() -> Option<Arc<Relay>> {
        relay_of(64)
    }

    fn relay_of(capacity: u32) -> Option<Arc<Relay>> {
        match Relay::new(capacity) {
            Ok(r) => Some(r),
            Err(e) if std::env::var_os("FULCRUM_REQUIRE_BPF").is_some() => {
                panic!("the kernel relay cannot start: {e}")
            }
            Err(e) => {
                eprintln!("skipped: the kernel relay cannot start here: {e}");
                None
            }
        }
    }

    #[test]
    fn the_program_is_what_the_module_doc_says() {
        let p = program(3, 4);
        assert_eq!(p.len(), 24 * 8);
        let imm =
            |i: usize| i32::from_le_bytes([p[i * 8 + 4], p[i * 8 + 5], p[i * 8 + 6], p[i * 8 + 7]]);
        let off = |i: usize| i16::from_le_bytes([p[i * 8 + 2], p[i * 8 + 3]]);
        // The map descriptors land in the two 64-bit immediates.
        assert_eq!(&p[5 * 8..5 * 8 + 2], &[LD_IMM64, 0x11]);
        assert_eq!(imm(5), 3);
        assert_eq!(&p[16 * 8..16 * 8 + 2], &[LD_IMM64, 0x12]);
        assert_eq!(imm(16), 4);
        // Every jump lands on the SK_PASS at 22 (pc + 1 + off).
        for at in [2, 10, 13, 20] {
            assert_eq!(at + 1 + off(at as usize), 22, "jump at {at}");
        }
        assert_eq!(&p[22 * 8..22 * 8 + 2], &[MOV64_IMM, 0x00]);
        assert_eq!(imm(22), SK_PASS);
        // The mark goes into the second u32 of the peer entry the lookup returned.
        assert_eq!(&p[21 * 8..21 * 8 + 4], &[ST_W, 0x07, 4, 0]);
    }

    #[test]
    fn a_loopback_pair_relays_both_ways_with_bytes_queued_before() {
        let Some(r) = relay() else { return };
        r.self_test().expect("self-test");
        // Slots come back: as many self-tests as the relay has room for, and more.
        for _ in 0..70 {
            r.self_test().expect("again");
        }
    }

    /// A relay that cannot pass its self-test says so (what `kernel_relay: auto` then falls
    /// back on): here its only slot is taken.
    #[test]
    fn the_self_test_fails_on_a_relay_that_cannot_relay() {
        let Some(r) = relay_of(1) else { return };
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let a = std::net::TcpStream::connect(l.local_addr().expect("addr")).expect("a");
        let (b, _) = l.accept().expect("b");
        let held = r.splice(a.as_raw_fd(), b.as_raw_fd()).expect("splice");
        assert!(held.is_some());
        let e = r.self_test().expect_err("no room to test in");
        assert!(e.to_string().contains("no free slot"), "{e}");
        drop(held);
        r.self_test().expect("room again");
    }

    #[test]
    fn every_slot_taken_is_none_not_an_error() {
        let Some(r) = relay_of(1) else { return };
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let a = std::net::TcpStream::connect(l.local_addr().expect("addr")).expect("a");
        let (b, _) = l.accept().expect("b");
        let first = r.splice(a.as_raw_fd(), b.as_raw_fd()).expect("splice");
        assert!(first.is_some());
        let c = std::net::TcpStream::connect(l.local_addr().expect("addr")).expect("c");
        let (d, _) = l.accept().expect("d");
        assert!(
            r.splice(c.as_raw_fd(), d.as_raw_fd())
                .expect("full")
                .is_none()
        );
        drop(first);
        assert!(
            r.splice(c.as_raw_fd(), d.as_raw_fd())
                .expect("free")
                .is_some()
        );
    }

    /// A FIN that arrives alone (its data already relayed) reads as end of file on the
    /// socket that got it and leaves the peer's socket without an error, relaying on.
    #[test]
    fn a_fin_alone_is_end_of_file_and_no_error_on_the_peer() {
        use std::io::{Read, Write};
        use std::net::Shutdown;
        use std::time::Duration;
        let Some(r) = relay() else { return };
        let Loopback {
            mut client,
            front,
            back,
            mut server,
        } = Loopback::new().expect("loopback");
        let _pair = r
            .splice(front.as_raw_fd(), back.as_raw_fd())
            .expect("splice")
            .expect("slot");
        client.write_all(b"hello").expect("send");
        let mut got = [0u8; 5];
        server.read_exact(&mut got).expect("relayed");
        // The data is gone from the client's side: its FIN travels alone.
        std::thread::sleep(Duration::from_millis(30));
        client.shutdown(Shutdown::Write).expect("half-close");
        let mut rest = [0u8; 8];
        assert_eq!((&front).read(&mut rest).expect("end of file"), 0);
        std::thread::sleep(Duration::from_millis(30));
        assert!(back.take_error().expect("SO_ERROR").is_none());
        server.write_all(b"answer").expect("answer");
        let mut answer = [0u8; 6];
        client.read_exact(&mut answer).expect("answer relayed");
        assert_eq!(&answer, b"answer");
    }

    /// A segment that arrives while its peer is not yet in the map stays with its socket,
    /// and so does every later one of that direction: user space reads them all, in order,
    /// and nothing is redirected past them. The other direction is relayed by the kernel.
    #[test]
    fn bytes_that_find_no_peer_keep_their_direction_in_user_space_in_order() {
        use std::io::{Read, Write};
        use std::time::Duration;
        let Some(r) = relay() else { return };
        let Loopback {
            mut client,
            front,
            back,
            mut server,
        } = Loopback::new().expect("loopback");
        // The service answers while only its own socket is in the map.
        let _pair = r
            .splice_with(front.as_raw_fd(), back.as_raw_fd(), || {
                server.write_all(b"early;").expect("early");
                std::thread::sleep(Duration::from_millis(30));
            })
            .expect("splice")
            .expect("slot");
        server.write_all(b"later").expect("later");
        std::thread::sleep(Duration::from_millis(30));
        // Both reach the proxy side, in order; none reached the client by the kernel.
        let mut got = [0u8; 11];
        (&back).read_exact(&mut got).expect("kept");
        assert_eq!(&got, b"early;later");
        client.set_nonblocking(true).expect("nonblocking");
        let mut none = [0u8; 4];
        assert!(
            client.read(&mut none).is_err(),
            "nothing went round user space"
        );
        client.set_nonblocking(false).expect("blocking");
        // The client's direction is the kernel's.
        client.write_all(b"ask").expect("ask");
        let mut asked = [0u8; 3];
        server.read_exact(&mut asked).expect("relayed");
        assert_eq!(&asked, b"ask");
        let mut rest = [0u8; 4];
        front.set_nonblocking(true).expect("nonblocking");
        assert!(
            (&front).read(&mut rest).is_err(),
            "the client's bytes were not kept"
        );
    }

    /// A client whose FIN came with its request cannot enter the map: the service's socket
    /// stays in alone, keeping what it receives, and user space reads both sides in order.
    /// `Flow` does not count the FIN as a byte.
    #[test]
    fn a_client_already_half_closed_leaves_both_directions_to_user_space() {
        use std::io::{Read, Write};
        use std::net::Shutdown;
        use std::time::Duration;
        let Some(r) = relay() else { return };
        let Loopback {
            mut client,
            front,
            back,
            mut server,
        } = Loopback::new().expect("loopback");
        client.write_all(b"ask").expect("ask");
        client.shutdown(Shutdown::Write).expect("half-close");
        std::thread::sleep(Duration::from_millis(30));
        let _pair = r
            .splice(front.as_raw_fd(), back.as_raw_fd())
            .expect("splice")
            .expect("slot");
        let mut asked = Vec::new();
        (&front).read_to_end(&mut asked).expect("the client's side");
        assert_eq!(asked, b"ask");
        assert_eq!(flow(front.as_raw_fd()).expect("flow").received, 3);
        server.write_all(b"answer").expect("answer");
        let mut answer = [0u8; 6];
        (&back).read_exact(&mut answer).expect("kept");
        assert_eq!(&answer, b"answer");
        client.set_nonblocking(true).expect("nonblocking");
        let mut none = [0u8; 4];
        assert!(
            client.read(&mut none).is_err(),
            "nothing went round user space"
        );
    }
}
