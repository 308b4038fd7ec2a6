//! PURE: what a stateless proxy checks of a request before it forwards it (RFC 3261 §16.3)
//! and which requests open or end a dialog.

use super::*;

/// RFC 3261 §16.3 step 1 for a stateless proxy: the reply to a request a proxy cannot handle
/// as sent, or `None`. Every check reads values the scan already indexed (Request-URI, CSeq,
/// To, From), never the rest of the message: no second pass.
pub(super) fn request_syntax_error(msg: &SipMsg<'_>) -> Option<Reply<'static>> {
    // Mandatory headers (§8.1.1), and each of Call-ID, CSeq, From, To, Max-Forwards once
    // (RFC 4475 §3.3.8: the proxy cannot know which one the sender meant).
    if msg.missing_mandatory().is_some() || msg.has_duplicate_header() {
        return Some(Reply::BAD_REQUEST);
    }
    // To and From must be a name-addr or addr-spec around an absolute URI: an unbalanced
    // quote hides the URI (RFC 4475 §3.1.2.6).
    for v in [msg.to_header(), msg.from_header()] {
        if !v.is_some_and(names_an_absolute_uri) {
            return Some(Reply::BAD_REQUEST);
        }
    }
    let uri = msg.request_uri()?;
    if !is_absolute_uri(uri) {
        // §7.1 / §25.1: a bare absolute URI; `<sip:...>` is refused (RFC 4475 §3.1.2.7).
        return Some(Reply::BAD_REQUEST);
    }
    // Escaped headers in a SIP Request-URI (RFC 4475 §3.1.2.11): a proxy may refuse the
    // request or drop the headers, but must never forward them in the Request-URI. fulcrum
    // refuses: it forwards the start line byte for byte, and a sender that put headers there
    // has no request a downstream element could act on as meant (§19.1.5 makes them
    // meaningful only when a URI is turned into a request).
    if sip_uri_has_headers(uri) {
        return Some(Reply::BAD_REQUEST);
    }
    let method = msg.method()?;
    let cseq = msg.cseq()?;
    if cseq.method != method {
        // §8.1.1.5: the CSeq method matches the request's. RFC 4475 §3.1.2.17 answers 400;
        // §3.1.2.18 prefers 501 at a proxy when the start line's method is unknown.
        return Some(if SipMethod::from_bytes(method) == SipMethod::Other {
            Reply::NOT_IMPLEMENTED
        } else {
            Reply::BAD_REQUEST
        });
    }
    None
}

/// Whether a To / From value holds an absolute URI, as [`sip::parse_name_addr`] splits it:
/// without a double quote (nearly every message) the URI is between the first `<` and the
/// next `>`, or, with no `<`, everything before the first `;`; only a value with a quoted
/// display name needs the full parse. Two memchr instead of a parse on the per-request path.
fn names_an_absolute_uri(v: &[u8]) -> bool {
    if memchr::memchr(b'"', v).is_some() {
        return sip::parse_name_addr(v).is_some_and(|na| is_absolute_uri(na.uri));
    }
    let uri = match memchr::memchr(b'<', v) {
        Some(lt) => match memchr::memchr(b'>', &v[lt..]) {
            Some(gt) => &v[lt + 1..lt + gt],
            None => return false,
        },
        None => &v[..memchr::memchr(b';', v).unwrap_or(v.len())],
    };
    is_absolute_uri(uri.trim_ascii())
}

/// Whether a `sip:` / `sips:` URI carries `?headers` (RFC 3261 §19.1.1): a non-empty part
/// after a `?` that follows the last `@` (the user part may itself hold `?`), as
/// [`sip::parse_uri`] reads it, without the parse.
fn sip_uri_has_headers(uri: &[u8]) -> bool {
    let is_sip = uri
        .get(..4)
        .is_some_and(|s| s.eq_ignore_ascii_case(b"sip:"))
        || uri
            .get(..5)
            .is_some_and(|s| s.eq_ignore_ascii_case(b"sips:"));
    if !is_sip {
        return false;
    }
    let host_part = memchr::memrchr(b'@', uri).map_or(uri, |at| &uri[at + 1..]);
    memchr::memchr(b'?', host_part).is_some_and(|q| q + 1 < host_part.len())
}

/// RFC 3986 / RFC 3261 §25.1 `absoluteURI` shape: a scheme (ALPHA then ALPHA / DIGIT / `+` /
/// `-` / `.`), a colon and something after it.
fn is_absolute_uri(uri: &[u8]) -> bool {
    let Some(colon) = memchr::memchr(b':', uri) else {
        return false;
    };
    let scheme = &uri[..colon];
    scheme.first().is_some_and(u8::is_ascii_alphabetic)
        && scheme
            .iter()
            .all(|&c| c.is_ascii_alphanumeric() || matches!(c, b'+' | b'-' | b'.'))
        && colon + 1 < uri.len()
}

/// Whether a request ends its dialog: a BYE, or a CANCEL of the initial INVITE (no To tag; a
/// CANCEL of a re-INVITE only ends that transaction, RFC 3261 §9.1, §14.1).
pub(super) fn ends_dialog(msg: &SipMsg<'_>) -> bool {
    match msg.method_kind() {
        SipMethod::Bye => true,
        SipMethod::Cancel => msg.to_tag().is_none(),
        _ => false,
    }
}

/// Whether a request is pinned to the member it reached: the requests that create a dialog
/// (INVITE, SUBSCRIBE, REFER; RFC 3261 §12, RFC 6665, RFC 3515), REGISTER (its refreshes
/// reuse the Call-ID, §10.2.4, and belong on one registrar), and in-dialog requests (a To
/// tag) whose dialog fulcrum has not seen, e.g. after a restart. Other requests (OPTIONS,
/// MESSAGE, PUBLISH outside a dialog) open nothing: they would fill the dialog table and
/// count as load for the whole idle timeout. A request ending a dialog, and an ACK, pins
/// nothing.
pub(super) fn pins_dialog(msg: &SipMsg<'_>) -> bool {
    match msg.method_kind() {
        SipMethod::Invite | SipMethod::Register => true,
        SipMethod::Ack | SipMethod::Bye | SipMethod::Cancel => false,
        SipMethod::Options | SipMethod::Other => {
            matches!(msg.method(), Some(b"SUBSCRIBE" | b"REFER")) || msg.to_tag().is_some()
        }
    }
}
