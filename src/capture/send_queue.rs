//! How much a TCP socket still holds for its peer, which shows a collector that stopped
//! reading (docs/capture.md). Two `ioctl` calls, each writing one `int` the caller owns: the
//! module opts out of the crate's `deny(unsafe_code)` for them alone, as README.md says where
//! it lists the crate's `unsafe` code.
#![allow(unsafe_code)]

use std::net::TcpStream;
use std::os::fd::AsRawFd as _;

/// The bytes a TCP socket holds for its peer: all of them (sent and not yet acknowledged, or
/// not yet sent), and those not yet sent (Linux's `SIOCOUTQ` and `SIOCOUTQNSD`, tcp(7)).
pub(super) fn of(s: &TcpStream) -> Option<(i32, i32)> {
    use nix::libc;
    let (mut all, mut unsent): (libc::c_int, libc::c_int) = (0, 0);
    let fd = s.as_raw_fd();
    // SAFETY: both requests write one `int` through the pointer, which points to a live one;
    // `fd` is the open socket `s` borrows.
    let a = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &raw mut all) };
    // SAFETY: as above.
    let b = unsafe { libc::ioctl(fd, libc::SIOCOUTQNSD, &raw mut unsent) };
    (a == 0 && b == 0).then_some((all, unsent))
}
