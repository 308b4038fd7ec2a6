//! The TLS ClientHello reader (tcp vservers routing by SNI / ALPN without terminating): any
//! bytes, as a connection's first bytes. Nothing may panic, and a hello read whole stays read
//! with more bytes after it (the client's next flight). A name it returns is lower-case.
#![no_main]

use fulcrum::client_hello::{Hello, parse};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Hello::Read(h) = parse(data) {
        if let Some(sni) = &h.sni {
            assert!(!sni.iter().any(u8::is_ascii_uppercase));
        }
        let mut more = data.to_vec();
        more.extend_from_slice(&[23, 3, 3, 0, 1, 0]);
        assert_eq!(parse(&more), Hello::Read(h));
    }
});
