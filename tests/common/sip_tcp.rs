//! SIP over TCP peers for the sip-tcp tests: a framed reader, a UAS that answers 200 and
//! records what it saw, and a request builder.

use fulcrum::sip::{self, DEFAULT_MAX_MESSAGE, Frame, Reply, next_frame};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const WAIT: Duration = Duration::from_secs(5);

/// What [`next_message`] found.
pub enum Next {
    Message(Vec<u8>),
    /// Nothing complete within the wait.
    Timeout,
    /// The peer closed the stream, or sent something that does not frame.
    Closed,
}

/// A blocking stream whose reads can be bounded in time: TCP, or TLS over TCP.
pub trait TimedRead: Read {
    fn set_read_timeout(&self, d: Option<Duration>) -> std::io::Result<()>;
}

impl TimedRead for TcpStream {
    fn set_read_timeout(&self, d: Option<Duration>) -> std::io::Result<()> {
        TcpStream::set_read_timeout(self, d)
    }
}

impl<C, D> TimedRead for rustls::StreamOwned<C, TcpStream>
where
    C: std::ops::DerefMut<Target = rustls::ConnectionCommon<D>>,
    D: rustls::SideData,
{
    fn set_read_timeout(&self, d: Option<Duration>) -> std::io::Result<()> {
        self.sock.set_read_timeout(d)
    }
}

/// Read one framed SIP message (skipping keep-alives) from a blocking stream, waiting at
/// most `wait`.
pub fn next_message<S: TimedRead>(stream: &mut S, buf: &mut Vec<u8>, wait: Duration) -> Next {
    let deadline = Instant::now() + wait;
    loop {
        match next_frame(buf, DEFAULT_MAX_MESSAGE) {
            Ok(Frame::Message { len, .. }) => {
                let msg = buf[..len].to_vec();
                buf.drain(..len);
                return Next::Message(msg);
            }
            Ok(f) => {
                buf.drain(..f.len());
                continue;
            }
            Err(sip::FrameError::Incomplete) => {}
            Err(_) => return Next::Closed,
        }
        if Instant::now() > deadline {
            return Next::Timeout;
        }
        let mut chunk = [0u8; 4096];
        if stream
            .set_read_timeout(Some(Duration::from_millis(200)))
            .is_err()
        {
            return Next::Closed;
        }
        match stream.read(&mut chunk) {
            Ok(0) => return Next::Closed,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return Next::Closed,
        }
    }
}

/// Read one framed SIP message (skipping keep-alives), waiting at most [`WAIT`].
pub fn read_message<S: TimedRead>(stream: &mut S, buf: &mut Vec<u8>) -> Option<Vec<u8>> {
    match next_message(stream, buf, WAIT) {
        Next::Message(m) => Some(m),
        Next::Timeout | Next::Closed => None,
    }
}

/// A TCP UAS: answers every request but ACK with 200, records (Call-ID, method) of
/// requests and (Call-ID, status code) of responses, and can send a request back on the
/// connection fulcrum opened.
pub struct TcpUas {
    pub addr: SocketAddr,
    seen: Arc<Mutex<Vec<(String, String)>>>,
    pub conn: Arc<Mutex<Option<TcpStream>>>,
    stop: Arc<AtomicBool>,
}

impl TcpUas {
    pub fn start() -> TcpUas {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind uas");
        let addr = listener.local_addr().expect("addr");
        listener.set_nonblocking(true).expect("nonblocking");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let conn = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let (seen2, conn2, stop2) = (Arc::clone(&seen), Arc::clone(&conn), Arc::clone(&stop));
        std::thread::spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                let Ok((stream, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                stream.set_nonblocking(false).expect("blocking");
                *conn2.lock().expect("lock") = stream.try_clone().ok();
                let (seen3, stop3) = (Arc::clone(&seen2), Arc::clone(&stop2));
                std::thread::spawn(move || {
                    let mut stream = stream;
                    let mut buf = Vec::new();
                    while !stop3.load(Ordering::Relaxed) {
                        let bytes = match next_message(&mut stream, &mut buf, WAIT) {
                            Next::Message(b) => b,
                            Next::Timeout => continue,
                            Next::Closed => return,
                        };
                        let Ok(msg) = sip::scan(&bytes) else { continue };
                        let cid =
                            String::from_utf8_lossy(msg.call_id().unwrap_or(b"")).into_owned();
                        if !msg.is_request() {
                            // Responses to its own requests are recorded by status code.
                            let code = msg.status_code().map_or(0, u32::from);
                            seen3.lock().expect("lock").push((cid, code.to_string()));
                            continue;
                        }
                        let method =
                            String::from_utf8_lossy(msg.method().unwrap_or(b"")).into_owned();
                        seen3.lock().expect("lock").push((cid, method));
                        let mut out = Vec::new();
                        let ok = Reply {
                            code: 200,
                            reason: "OK",
                            retry_after_s: None,
                        };
                        if sip::build_response(&msg, &ok, &mut out).is_ok() {
                            let _ = stream.write_all(&out);
                        }
                    }
                });
            }
        });
        TcpUas {
            addr,
            seen,
            conn,
            stop,
        }
    }

    /// Every message seen so far: (Call-ID, method or status code).
    pub fn calls(&self) -> Vec<(String, String)> {
        self.seen.lock().expect("lock").clone()
    }

    /// The methods (and status codes) seen for one Call-ID, in order.
    pub fn methods_of(&self, call_id: &str) -> Vec<String> {
        self.calls()
            .into_iter()
            .filter(|(c, _)| c == call_id)
            .map(|(_, m)| m)
            .collect()
    }
}

impl Drop for TcpUas {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A request of a client at `local` (Via sent-by and Contact), with its own branch.
pub fn request(method: &str, call_id: &str, local: SocketAddr, branch: &str) -> String {
    format!(
        "{method} sip:svc@example.com SIP/2.0\r\nVia: SIP/2.0/TCP {local};branch=z9hG4bK{branch}\r\nMax-Forwards: 70\r\nFrom: <sip:a@client>;tag=a1\r\nTo: <sip:svc@example.com>\r\nCall-ID: {call_id}\r\nCSeq: 1 {method}\r\nContact: <sip:a@{local};transport=tcp>\r\nContent-Length: 0\r\n\r\n"
    )
}
