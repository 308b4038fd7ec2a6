//! Batched sends on many sockets in one system call (io_uring), with a plain `send` per
//! socket where io_uring is not available. IO.
//!
//! The `udp` vserver forwards a recvmmsg batch of client datagrams to as many session
//! sockets, one connected socket per session, so sendmmsg (one socket) cannot batch them.
//! One `io_uring_enter` carrying every send of the batch replaces one `send` each: fewer
//! system calls, and above all the worker is not switched out after each send to run the
//! service the send just woke (measured: BENCHMARKS.md, "UDP: a receive batch goes to the services in one system
//! call").
//!
//! This is the one module of the crate with `unsafe`: a submission names a buffer by
//! address, and the kernel reads it later. [`SendBatch::send_all`] borrows every buffer for
//! its whole call and returns only once the kernel has reported every submitted send
//! complete; each send carries `MSG_DONTWAIT`, which makes io_uring finish it during the
//! submitting call (a full socket buffer completes it with EAGAIN instead of parking it for
//! a later retry), so no submitted send outlives the call. (A kernel that parked it anyway
//! would make the call wait for buffer room, a delay, not a hazard: the call still returns
//! only after every completion.)

#![allow(unsafe_code)]

use io_uring::{IoUring, opcode, types};
use nix::sys::socket::{MsgFlags, send};
use std::io;
use std::os::fd::RawFd;

/// Sends per ring submission at most (larger batches go in several submissions).
const RING_ENTRIES: u32 = 64;
// A chunk's completions are tracked in one u64 bitmask.
const _: () = assert!(RING_ENTRIES <= 64);

/// Turns io_uring off (`FULCRUM_IO_URING=off`): every send is a plain `send`.
pub const ENV_SWITCH: &str = "FULCRUM_IO_URING";

/// Sends to many sockets at once: one io_uring submission per batch when the kernel allows
/// io_uring, one `send` per socket otherwise.
pub struct SendBatch {
    ring: Option<IoUring>,
}

impl std::fmt::Debug for SendBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendBatch")
            .field("io_uring", &self.ring.is_some())
            .finish()
    }
}

impl SendBatch {
    /// A batch sender; io_uring when the kernel offers it (it may be missing, disabled by
    /// `kernel.io_uring_disabled`, or refused by a seccomp filter) and [`ENV_SWITCH`] is not
    /// `off`.
    pub fn new() -> SendBatch {
        let off = std::env::var(ENV_SWITCH).is_ok_and(|v| v == "off");
        let ring = if off {
            None
        } else {
            match IoUring::new(RING_ENTRIES) {
                Ok(ring) if sends_supported(&ring) => Some(ring),
                Ok(_) => {
                    tracing::info!("io_uring has no send operation here: plain sends");
                    None
                }
                Err(e) => {
                    tracing::info!(error = %e, "io_uring unavailable: plain sends");
                    None
                }
            }
        };
        SendBatch { ring }
    }

    /// A sender over a ring of `entries` (a ring smaller than a chunk fails its submission:
    /// the test of the fallback).
    #[cfg(test)]
    fn with_ring_entries(entries: u32) -> SendBatch {
        SendBatch {
            ring: IoUring::new(entries).ok(),
        }
    }

    /// A sender that always uses one `send` per socket.
    #[cfg(test)]
    fn plain() -> SendBatch {
        SendBatch { ring: None }
    }

    /// True when sends go through io_uring.
    pub fn uses_io_uring(&self) -> bool {
        self.ring.is_some()
    }

    /// Send `sends[i].1` on socket `sends[i].0`, without blocking; `results[i]` is the byte
    /// count sent (possibly short, for a stream socket) or the error. Returns once every
    /// send has completed. Each send is made exactly once, also when the ring fails midway
    /// (what it did not take is then sent with `send`), so a stream never gets bytes twice.
    pub fn send_all(&mut self, sends: &[(RawFd, &[u8])], results: &mut Vec<io::Result<usize>>) {
        results.clear();
        results.extend(sends.iter().map(|_| Err(io::ErrorKind::Other.into())));
        for (c, chunk) in sends.chunks(RING_ENTRIES as usize).enumerate() {
            let at = c * RING_ENTRIES as usize;
            let out = &mut results[at..at + chunk.len()];
            let mut done: u64 = 0;
            if let Some(ring) = self.ring.as_mut()
                && let Err(e) = submit_chunk(ring, chunk, out, &mut done)
            {
                // Should not happen with a ring this size and every completion reaped.
                tracing::warn!(error = %e, "io_uring submission failed: plain sends from now on");
                self.ring = None;
            }
            for (i, (fd, buf)) in chunk.iter().enumerate() {
                if done & (1 << i) == 0 {
                    out[i] = send(*fd, buf, MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL)
                        .map_err(io::Error::from);
                }
            }
        }
    }
}

impl Default for SendBatch {
    fn default() -> SendBatch {
        SendBatch::new()
    }
}

/// Submit `chunk` (at most `RING_ENTRIES` sends) and wait for all its completions, setting
/// bit `i` of `done` for each one reported. Returns only once every entry the kernel took has
/// completed, also on an error: the entries without a bit then were never taken (they stay
/// in the submission queue, which nothing else reads: the ring has no SQPOLL thread, and the
/// caller drops it), so the caller may send exactly those another way.
fn submit_chunk(
    ring: &mut IoUring,
    chunk: &[(RawFd, &[u8])],
    results: &mut [io::Result<usize>],
    done: &mut u64,
) -> io::Result<()> {
    let mut pushed = 0;
    let mut failed = None;
    {
        let mut sq = ring.submission();
        for (i, (fd, buf)) in chunk.iter().enumerate() {
            let len = u32::try_from(buf.len()).unwrap_or(u32::MAX);
            let entry = opcode::Send::new(types::Fd(*fd), buf.as_ptr(), len)
                .flags(MsgFlags::MSG_DONTWAIT.bits())
                .build()
                .user_data(i as u64);
            // SAFETY: `buf` is borrowed from `chunk`, which outlives this function, and this
            // function returns only after the completion of every entry the kernel took has
            // been reaped (below, on every path), so the kernel never reads a buffer after it
            // is released; an entry it did not take is never read (no SQPOLL; the caller drops
            // the ring after an error). The queue holds RING_ENTRIES entries, empty on entry
            // (every earlier submission was reaped whole), and `chunk` has at most that many.
            if unsafe { sq.push(&entry) }.is_err() {
                failed = Some(io::Error::other("io_uring submission queue full"));
                break;
            }
            pushed += 1;
        }
    }
    let mut count = 0;
    let mut waits = 0u32;
    loop {
        // Entries the kernel has taken: those pushed and no longer in the queue.
        let taken = pushed - ring.submission().len();
        let want = if failed.is_some() { taken } else { pushed };
        if count >= want {
            break;
        }
        if failed.is_none() {
            match ring.submit_and_wait(want - count) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => failed = Some(e),
            }
        }
        // After a failure nothing more is submitted (any enter would also submit what the
        // kernel did not take, which the caller then sends another way); completions of what
        // it took arrive on their own.
        for cqe in ring.completion() {
            let i = cqe.user_data() as usize;
            let r = cqe.result();
            if let Some(slot) = results.get_mut(i) {
                *slot = if r >= 0 {
                    Ok(r as usize)
                } else {
                    Err(io::Error::from_raw_os_error(-r))
                };
                *done |= 1 << i;
            }
            count += 1;
        }
        if failed.is_some() && count < pushed - ring.submission().len() {
            // A MSG_DONTWAIT send completes inside the call that took it, so this is not
            // expected; still, never return while the kernel may read a buffer.
            waits += 1;
            if waits == 1 {
                tracing::warn!(
                    "io_uring: waiting for sends already taken before giving the ring up"
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// True when the kernel knows IORING_OP_SEND (5.6 and later; a kernel too old to answer the
/// probe does not either): on an older one every send would complete with EINVAL.
fn sends_supported(ring: &IoUring) -> bool {
    let mut probe = io_uring::Probe::new();
    ring.submitter().register_probe(&mut probe).is_ok() && probe.is_supported(opcode::Send::CODE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::UdpSocket;
    use std::os::fd::AsRawFd;

    fn pair() -> (UdpSocket, UdpSocket) {
        let rx = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let tx = UdpSocket::bind("127.0.0.1:0").expect("bind");
        tx.connect(rx.local_addr().expect("addr")).expect("connect");
        rx.set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .expect("timeout");
        (tx, rx)
    }

    fn sends_reach_every_socket(mut batch: SendBatch) {
        // More sockets than one ring submission holds, so the chunking is exercised.
        let pairs: Vec<_> = (0..RING_ENTRIES as usize + 7).map(|_| pair()).collect();
        let bodies: Vec<Vec<u8>> = (0..pairs.len())
            .map(|i| format!("datagram {i}").into_bytes())
            .collect();
        let sends: Vec<(RawFd, &[u8])> = pairs
            .iter()
            .zip(&bodies)
            .map(|((tx, _), b)| (tx.as_raw_fd(), b.as_slice()))
            .collect();
        let mut results = Vec::new();
        batch.send_all(&sends, &mut results);
        assert_eq!(results.len(), pairs.len());
        for (i, ((_, rx), body)) in pairs.iter().zip(&bodies).enumerate() {
            assert_eq!(results[i].as_ref().ok(), Some(&body.len()), "send {i}");
            let mut buf = [0u8; 64];
            let n = rx.recv(&mut buf).expect("datagram arrives");
            assert_eq!(&buf[..n], body.as_slice());
            rx.set_nonblocking(true).expect("nonblocking");
            assert!(rx.recv(&mut buf).is_err(), "send {i} went twice");
        }
    }

    #[test]
    fn batched_sends_reach_every_socket() {
        let batch = SendBatch::new();
        // Where the kernel refuses io_uring this is the plain path, tested below anyway.
        eprintln!("io_uring in use: {}", batch.uses_io_uring());
        sends_reach_every_socket(batch);
    }

    #[test]
    fn plain_sends_reach_every_socket() {
        sends_reach_every_socket(SendBatch::plain());
    }

    #[test]
    fn a_failed_submission_sends_each_datagram_once_and_plainly_from_then_on() {
        // A one-entry ring cannot take a batch of three: nothing is submitted, all three go
        // with `send`, none twice, and the sender gives the ring up.
        let mut batch = SendBatch::with_ring_entries(1);
        if !batch.uses_io_uring() {
            eprintln!("io_uring is not available here: nothing to fail");
            return;
        }
        let pairs: Vec<_> = (0..3).map(|_| pair()).collect();
        let sends: Vec<(RawFd, &[u8])> = pairs
            .iter()
            .map(|(tx, _)| (tx.as_raw_fd(), &b"once"[..]))
            .collect();
        let mut results = Vec::new();
        batch.send_all(&sends, &mut results);
        assert!(!batch.uses_io_uring());
        for ((_, rx), r) in pairs.iter().zip(&results) {
            assert_eq!(r.as_ref().ok(), Some(&4));
            let mut buf = [0u8; 8];
            assert_eq!(rx.recv(&mut buf).expect("arrives"), 4);
            rx.set_nonblocking(true).expect("nonblocking");
            assert!(rx.recv(&mut buf).is_err(), "sent twice");
        }
    }

    #[test]
    fn a_failing_send_is_reported_and_the_others_go() {
        for batch in [SendBatch::new(), SendBatch::plain()] {
            let mut batch = batch;
            let (tx, rx) = pair();
            // An unconnected socket cannot `send`: EDESTADDRREQ for its entry only.
            let loose = UdpSocket::bind("127.0.0.1:0").expect("bind");
            let sends = [
                (loose.as_raw_fd(), &b"nowhere"[..]),
                (tx.as_raw_fd(), &b"somewhere"[..]),
            ];
            let mut results = Vec::new();
            batch.send_all(&sends, &mut results);
            assert!(results[0].is_err(), "{:?}", results[0]);
            assert_eq!(results[1].as_ref().ok(), Some(&9));
            let mut buf = [0u8; 16];
            let n = rx.recv(&mut buf).expect("datagram arrives");
            assert_eq!(&buf[..n], b"somewhere");
        }
    }
}
