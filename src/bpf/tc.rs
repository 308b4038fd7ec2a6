//! The cls_bpf fallback for kernels without tcx (before Linux 6.6): a `clsact` qdisc and a
//! direct-action `bpf` filter on its ingress hook, set over rtnetlink (RFC 3549). IO, no
//! `unsafe` (nix's netlink socket). Message layouts: include/uapi/linux/rtnetlink.h,
//! pkt_sched.h, pkt_cls.h.
//!
//! The filter has a fixed priority and handle, so a restart replaces it in place
//! (`NLM_F_REPLACE`): the kernel swaps the program between two packets, as tcx's link update
//! does. It is not pinned; it stays on the qdisc until [`remove`].

use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, recv, sendto,
    socket,
};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

const RTM_NEWQDISC: u16 = 36;
const RTM_NEWTFILTER: u16 = 44;
const RTM_DELTFILTER: u16 = 45;
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_REPLACE: u16 = 0x100;
const NLM_F_CREATE: u16 = 0x400;
const TCA_KIND: u16 = 1;
const TCA_OPTIONS: u16 = 2;
const TCA_BPF_FD: u16 = 6;
const TCA_BPF_NAME: u16 = 7;
const TCA_BPF_FLAGS: u16 = 8;
const TCA_BPF_FLAG_ACT_DIRECT: u32 = 1;
const NLA_F_NESTED: u16 = 0x8000;
const TC_H_CLSACT: u32 = 0xffff_fff1;
const TC_H_INGRESS: u32 = 0xffff_fff2;
const ETH_P_ALL: u16 = 0x0003;
/// The filter's priority and handle on the ingress hook (the ASCII bytes "fc").
const PRIO: u32 = 0x6663;
const HANDLE: u32 = 1;

/// A request: header, `tcmsg`, then attributes.
struct Msg(Vec<u8>);

impl Msg {
    fn new(kind: u16, flags: u16, ifindex: u32, handle: u32, parent: u32, info: u32) -> Msg {
        let mut b = Vec::with_capacity(128);
        b.extend_from_slice(&0u32.to_ne_bytes());
        b.extend_from_slice(&kind.to_ne_bytes());
        b.extend_from_slice(&(flags | NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
        b.extend_from_slice(&1u32.to_ne_bytes());
        b.extend_from_slice(&0u32.to_ne_bytes());
        // struct tcmsg: family, 3 bytes of padding, ifindex, handle, parent, info.
        b.extend_from_slice(&[0, 0, 0, 0]);
        b.extend_from_slice(&ifindex.to_ne_bytes());
        b.extend_from_slice(&handle.to_ne_bytes());
        b.extend_from_slice(&parent.to_ne_bytes());
        b.extend_from_slice(&info.to_ne_bytes());
        Msg(b)
    }

    fn attr(&mut self, kind: u16, data: &[u8]) {
        let len = 4 + data.len();
        self.0.extend_from_slice(&(len as u16).to_ne_bytes());
        self.0.extend_from_slice(&kind.to_ne_bytes());
        self.0.extend_from_slice(data);
        while !self.0.len().is_multiple_of(4) {
            self.0.push(0);
        }
    }

    /// A nested attribute whose content `inner` writes.
    fn nested(&mut self, kind: u16, inner: impl FnOnce(&mut Msg)) {
        let at = self.0.len();
        self.attr(kind | NLA_F_NESTED, &[]);
        inner(self);
        let len = (self.0.len() - at) as u16;
        self.0[at..at + 2].copy_from_slice(&len.to_ne_bytes());
    }

    fn finish(mut self) -> Vec<u8> {
        let len = self.0.len() as u32;
        self.0[..4].copy_from_slice(&len.to_ne_bytes());
        self.0
    }
}

/// Send one request and read its acknowledgement: the kernel's error, if any.
fn request(msg: Msg) -> io::Result<()> {
    let sock: OwnedFd = socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkRoute,
    )?;
    let kernel = NetlinkAddr::new(0, 0);
    bind(sock.as_raw_fd(), &kernel)?;
    let bytes = msg.finish();
    sendto(sock.as_raw_fd(), &bytes, &kernel, MsgFlags::empty())?;
    let mut buf = [0u8; 4096];
    let n = recv(sock.as_raw_fd(), &mut buf, MsgFlags::empty())?;
    let reply = buf
        .get(..n)
        .filter(|r| r.len() >= 20)
        .ok_or_else(|| io::Error::other("short rtnetlink reply"))?;
    let kind = u16::from_ne_bytes([reply[4], reply[5]]);
    if kind != NLMSG_ERROR {
        return Err(io::Error::other(format!("rtnetlink replied type {kind}")));
    }
    match i32::from_ne_bytes([reply[16], reply[17], reply[18], reply[19]]) {
        0 => Ok(()),
        e => Err(io::Error::from_raw_os_error(-e)),
    }
}

/// Put program `prog_fd` on `ifindex`'s ingress as a direct-action cls_bpf filter (a
/// `clsact` qdisc added if missing), in place of the one a previous start put there.
pub(crate) fn attach(ifindex: u32, prog_fd: i32, name: &str) -> io::Result<()> {
    let mut q = Msg::new(
        RTM_NEWQDISC,
        NLM_F_CREATE,
        ifindex,
        0xffff_0000,
        TC_H_CLSACT,
        0,
    );
    q.attr(TCA_KIND, b"clsact\0");
    match request(q) {
        Err(e) if e.raw_os_error() != Some(nix::libc::EEXIST) => return Err(e),
        _ => {}
    }
    let info = PRIO << 16 | u32::from(ETH_P_ALL.to_be());
    let mut f = Msg::new(
        RTM_NEWTFILTER,
        NLM_F_CREATE | NLM_F_REPLACE,
        ifindex,
        HANDLE,
        TC_H_INGRESS,
        info,
    );
    f.attr(TCA_KIND, b"bpf\0");
    f.nested(TCA_OPTIONS, |o| {
        o.attr(TCA_BPF_FD, &prog_fd.to_ne_bytes());
        let mut n = name.as_bytes().to_vec();
        n.push(0);
        o.attr(TCA_BPF_NAME, &n);
        o.attr(TCA_BPF_FLAGS, &TCA_BPF_FLAG_ACT_DIRECT.to_ne_bytes());
    });
    request(f)
}

/// Remove the filter [`attach`] put on `ifindex` (the qdisc stays: others may use it).
pub(crate) fn remove(ifindex: u32) -> io::Result<()> {
    let info = PRIO << 16 | u32::from(ETH_P_ALL.to_be());
    let mut f = Msg::new(RTM_DELTFILTER, 0, ifindex, HANDLE, TC_H_INGRESS, info);
    f.attr(TCA_KIND, b"bpf\0");
    match request(f) {
        Err(e) if e.raw_os_error() == Some(nix::libc::ENOENT) => Ok(()),
        r => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The request's bytes as rtnetlink reads them: lengths, padding, the nested options.
    #[test]
    fn a_filter_request_is_laid_out_as_rtnetlink_reads_it() {
        let mut f = Msg::new(RTM_NEWTFILTER, NLM_F_CREATE, 7, HANDLE, TC_H_INGRESS, 0);
        f.attr(TCA_KIND, b"bpf\0");
        f.nested(TCA_OPTIONS, |o| {
            o.attr(TCA_BPF_FD, &9i32.to_ne_bytes());
            o.attr(TCA_BPF_NAME, b"ab\0");
        });
        let b = f.finish();
        assert_eq!(
            u32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as usize,
            b.len()
        );
        assert!(b.len().is_multiple_of(4));
        assert_eq!(
            u32::from_ne_bytes([b[20], b[21], b[22], b[23]]),
            7,
            "ifindex"
        );
        // TCA_KIND at 36: 4 + "bpf\0".
        assert_eq!(u16::from_ne_bytes([b[36], b[37]]), 8);
        // The nest at 44 holds the fd (8 bytes) and the name (4 + 3, padded to 8).
        assert_eq!(u16::from_ne_bytes([b[44], b[45]]), 4 + 8 + 8);
        assert_eq!(
            u16::from_ne_bytes([b[46], b[47]]),
            TCA_OPTIONS | NLA_F_NESTED
        );
    }
}
