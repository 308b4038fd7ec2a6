//! PURE: what a `tcp` / `http` vserver reads of a connection before it chooses (nothing, an
//! HTTP/1.x request head, or a token's bytes) and the key the method hashes from it and the
//! connection's addresses. The shell (`proxy::tcp`) reads the bytes, bounded in size and
//! time, and asks.

use crate::balancer::KeyInput;
use crate::config::{HashParams, Method, Protocol, TokenRule, Vserver};
use crate::hash;
use crate::http::{self, HttpError};
use crate::key::{self, KeyOutcome, Payload, RequestCtx};
use std::net::SocketAddr;

/// What the first bytes of a connection must contain before a member can be chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FirstBytes {
    /// Nothing: choose at accept.
    None,
    /// A complete HTTP/1.x request head.
    HttpHead,
    /// At least this many bytes (`token` offset + length).
    Bytes(usize),
}

/// The keying of one tcp / http vserver: its method, the method's parameters and what must
/// be read first.
#[derive(Debug, Clone)]
pub struct ConnectionKeys {
    method: Method,
    hash_params: HashParams,
    first: FirstBytes,
}

impl ConnectionKeys {
    /// The keying of vserver `v`.
    pub fn new(v: &Vserver) -> ConnectionKeys {
        let first = match (v.protocol, v.method, &v.hash.token) {
            (_, Method::Token, Some(TokenRule::Payload { offset, length })) => {
                FirstBytes::Bytes(offset.saturating_add(*length).min(http::MAX_HEAD))
            }
            (Protocol::Http, Method::UrlHash | Method::DomainHash | Method::Token, _) => {
                FirstBytes::HttpHead
            }
            _ => FirstBytes::None,
        };
        ConnectionKeys {
            method: v.method,
            hash_params: v.hash.clone(),
            first,
        }
    }

    /// True when the key uses the connection's local address (`dest_ip_hash`,
    /// `source_dest_ip_hash`).
    pub fn reads_local(&self) -> bool {
        key::reads_local(self.method)
    }

    /// What must be read before choosing.
    pub fn first_bytes_needed(&self) -> FirstBytes {
        self.first
    }

    /// True when `buf` holds enough to choose (or can never be enough: too large, or not
    /// HTTP at all).
    pub fn is_first_complete(&self, buf: &[u8]) -> bool {
        match self.first {
            FirstBytes::None => true,
            FirstBytes::Bytes(n) => buf.len() >= n,
            FirstBytes::HttpHead => !matches!(http::parse_head(buf), Err(HttpError::Incomplete)),
        }
    }

    /// The balancer's key for a connection from `client` to `local` whose first bytes are
    /// `first` (empty when none were needed or none came), and whether an HTTP head that was
    /// needed did not parse.
    pub fn key_input(
        &self,
        first: &[u8],
        client: SocketAddr,
        local: SocketAddr,
    ) -> (KeyInput, bool) {
        let head;
        let payload = match self.first {
            FirstBytes::HttpHead => match http::parse_head(first) {
                Ok(h) => {
                    head = h;
                    Payload::Http(&head)
                }
                Err(_) => return (KeyInput::Unparseable, true),
            },
            FirstBytes::Bytes(_) => Payload::Raw(first),
            FirstBytes::None => Payload::None,
        };
        let ctx = RequestCtx {
            src: client,
            dst: local,
            payload,
        };
        let key = match key::extract(self.method, &self.hash_params, &ctx) {
            KeyOutcome::Key(k) => KeyInput::Hash(hash::key_hash(k.as_bytes())),
            KeyOutcome::NoKey => KeyInput::NoKey,
            KeyOutcome::Unparseable => KeyInput::Unparseable,
        };
        (key, false)
    }
}
