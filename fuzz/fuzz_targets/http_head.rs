//! The HTTP/1.x request head parser (http vservers' url_hash / domain_hash / token): any
//! bytes, and every accessor of a head it accepts. Nothing may panic.
#![no_main]

use fulcrum::http::parse_head;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = parse_head(data) {
        let _ = format!("{h:?}");
    }
});
