//! sip-tcp framing across arbitrary read splits: a stream cut into reads anywhere, framed by a
//! resumable `Framer` as the connection reader does (accumulate, frame while complete, keep
//! the rest, each read's bytes read once), must frame into the same messages as the whole
//! stream at once by `next_frame`. Every framed message is then scanned
//! and, when it scans as a request, forwarded; what is forwarded must frame again as one
//! message of its own length. Nothing may panic.
#![no_main]

use fulcrum::sip::{
    FrameError, Framer, Local, RequestRewrite, Transport, forward_request, next_frame, scan,
};
use libfuzzer_sys::fuzz_target;

const MAX: usize = 65_536;

/// Frames of `stream` read whole by `next_frame`; the error once framing fails for good.
fn whole_frames(stream: &[u8]) -> (Vec<Vec<u8>>, Option<FrameError>) {
    let mut out = Vec::new();
    let mut at = 0;
    while at < stream.len() {
        match next_frame(&stream[at..], MAX) {
            Ok(f) => {
                out.push(stream[at..at + f.len()].to_vec());
                at += f.len();
            }
            Err(FrameError::Incomplete) => break,
            Err(e) => return (out, Some(e)),
        }
    }
    (out, None)
}

/// Frames of `stream` fed in reads of the given sizes to one `Framer`; the error once
/// framing fails for good.
fn frames(stream: &[u8], reads: &[usize]) -> (Vec<Vec<u8>>, Option<FrameError>) {
    let mut buf = Vec::new();
    let mut out = Vec::new();
    let mut framer = Framer::default();
    let mut at = 0;
    let mut sizes = reads.iter().copied().cycle();
    while at < stream.len() {
        let n = sizes.next().unwrap_or(1).clamp(1, stream.len() - at);
        buf.extend_from_slice(&stream[at..at + n]);
        at += n;
        loop {
            match framer.frame(&buf, MAX) {
                Ok(f) => {
                    let len = f.len();
                    out.push(buf[..len].to_vec());
                    buf.drain(..len);
                }
                Err(FrameError::Incomplete) => break,
                Err(e) => return (out, Some(e)),
            }
        }
    }
    (out, None)
}

fuzz_target!(|data: &[u8]| {
    let Some((&k, rest)) = data.split_first() else {
        return;
    };
    // Read sizes from the first bytes: 1..=64, as many as the first byte says (mod 8).
    let count = usize::from(k % 8) + 1;
    let (sizes, stream) = rest.split_at(count.min(rest.len()));
    let reads: Vec<usize> = sizes.iter().map(|&b| usize::from(b % 64) + 1).collect();
    let whole = whole_frames(stream);
    let split = frames(stream, &reads);
    assert_eq!(whole, split, "framing depends on where the reads fall");
    let local = Local::new("192.0.2.1", 5060, Transport::Tcp);
    let src = "198.51.100.7:40000".parse().expect("addr");
    for msg in &whole.0 {
        let Ok(m) = scan(msg) else { continue };
        let rw = RequestRewrite {
            local: &local,
            src,
            record_route: true,
            force_rport: false,
            conn_id: Some(7),
            service: Some(0x0123_4567_89ab_cdef),
            arrived_on: None,
            flow: None,
            path: None,
        };
        let mut out = Vec::new();
        if m.is_request() && forward_request(&m, &rw, &mut out).is_ok() {
            match next_frame(&out, 2 * MAX) {
                Ok(f) => assert_eq!(f.len(), out.len(), "a forwarded message frames whole"),
                Err(e) => panic!("a forwarded message does not frame: {e}"),
            }
        }
    }
});
