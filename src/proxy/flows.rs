//! The keys of flow tokens for this process (docs/sip.md, "Path and flow tokens"): those of
//! `flow_key_file`, or a random key of this process's own; and the nonce of this start,
//! written into stream tokens. IO: reads the system's random source once.

use crate::config::Config;
use crate::sip::flow::{FlowKey, FlowKeys};
use std::sync::{Arc, OnceLock};

/// This start's nonce and its own key, drawn once.
fn start() -> (u64, FlowKey) {
    static START: OnceLock<(u64, FlowKey)> = OnceLock::new();
    *START.get_or_init(|| {
        use ring::rand::SecureRandom;
        let rng = ring::rand::SystemRandom::new();
        let mut bytes = [0u8; 24];
        if rng.fill(&mut bytes).is_err() {
            // No random source at all: the clock still makes the nonce differ between
            // starts, and the key is one no one can predict from outside the host.
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let mixed = xxhash_rust::xxh3::xxh3_128(&t.to_le_bytes()).to_le_bytes();
            bytes[..16].copy_from_slice(&mixed);
            bytes[16..].copy_from_slice(&(t as u64).to_le_bytes());
            tracing::warn!("no system random source: flow tokens keyed from the clock");
        }
        let mut key = [0u8; 16];
        key.copy_from_slice(&bytes[..16]);
        let mut nonce = [0u8; 8];
        nonce.copy_from_slice(&bytes[16..]);
        (u64::from_le_bytes(nonce), key)
    })
}

/// The flow keys `config` gives this process.
pub(crate) fn keys_for(config: &Config) -> Arc<FlowKeys> {
    let (nonce, own) = start();
    let from_file = config
        .flow_key_file
        .as_ref()
        .and_then(|f| FlowKeys::new(f.keys.clone(), nonce, false));
    Arc::new(from_file.unwrap_or_else(|| FlowKeys::own(own, nonce)))
}
