//! Small numbers and addresses written into SIP headers on the stack, without allocating: the
//! decimal and hexadecimal values of branches and parameters, `received` addresses. PURE.

use std::fmt::Write as _;
use std::net::IpAddr;

/// A few bytes formatted on the stack.
pub(super) struct Small<const N: usize> {
    buf: [u8; N],
    len: usize,
}

impl<const N: usize> Small<N> {
    pub(super) fn as_slice(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl<const N: usize> std::fmt::Write for Small<N> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let b = s.as_bytes();
        let end = self.len + b.len();
        if end > N {
            return Err(std::fmt::Error);
        }
        self.buf[self.len..end].copy_from_slice(b);
        self.len = end;
        Ok(())
    }
}

pub(super) fn dec(mut n: u64) -> Small<20> {
    let mut tmp = [0u8; 20];
    let mut i = tmp.len();
    loop {
        i -= 1;
        tmp[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let mut s = Small {
        buf: [0u8; 20],
        len: 20 - i,
    };
    s.buf[..s.len].copy_from_slice(&tmp[i..]);
    s
}

pub(super) fn hex16(n: u64) -> [u8; 16] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o = HEX[((n >> (60 - 4 * i)) & 0xf) as usize];
    }
    out
}

pub(super) fn parse_hex(s: &[u8]) -> Option<u64> {
    if s.is_empty() || s.len() > 16 {
        return None;
    }
    s.iter().try_fold(0u64, |a, &c| {
        let d = (c as char).to_digit(16)?;
        Some(a << 4 | u64::from(d))
    })
}

/// An address as the `received` grammar writes it: IPv6 without brackets (RFC 3261 §20.42).
pub(super) fn ip_text(ip: IpAddr) -> Small<48> {
    let mut s = Small {
        buf: [0u8; 48],
        len: 0,
    };
    // 45 bytes is the longest IPv6 text form, so this cannot fail.
    let _ = write!(s, "{ip}");
    s
}
