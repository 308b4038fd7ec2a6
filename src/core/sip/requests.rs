//! PURE: requests: a client's request checked, chosen for and forwarded, a service's
//! request toward a client routed, and fulcrum's own replies (RFC 3261 §16).

use super::checks::{ends_dialog, pins_dialog, request_syntax_error};
use super::*;
use crate::route::Target;

impl SipCore {
    /// A message that does not scan. A client's request whose start line and headers are
    /// sound is answered rather than dropped, so its sender learns why: 505 for another SIP
    /// version (RFC 3261 §8.2.1 step 1 analogue for a proxy, RFC 4475 §3.1.2.16), 400 for a
    /// Content-Length that is malformed, conflicting or larger than the datagram or WebSocket
    /// message (RFC 3261 §18.3, RFC 4475 §3.1.2.2, §3.1.2.3, §3.3.9). A missing Content-Length
    /// is no error on a datagram (§18.3) and never gets here. A message past the scanner's
    /// header-line limit is [`SipCore::refuse_too_large`]'s. Everything else is dropped.
    pub(super) fn unscannable(
        &self,
        buf: &[u8],
        e: sip::ScanError,
        origin: Origin,
        src: SocketAddr,
        out: &mut Vec<u8>,
    ) -> Action {
        let reply = match (origin, e) {
            (_, sip::ScanError::TooManyHeaders) => {
                bump(&self.counters.over_header_limit);
                return self.refuse_too_large(buf, origin, src, out);
            }
            (Origin::Client { .. }, sip::ScanError::BadVersion) => Reply::VERSION_NOT_SUPPORTED,
            // LWS in or around the Request-URI, trailing whitespace (RFC 4475 §3.1.2.8 to
            // §3.1.2.10): a request, but not one fulcrum can forward byte for byte.
            (
                Origin::Client { .. },
                sip::ScanError::BadContentLength | sip::ScanError::BadStartLine,
            ) => Reply::BAD_REQUEST,
            // A datagram, or a WebSocket message (RFC 7118 §5.1: one SIP message per
            // WebSocket message, framed by it as a datagram is), whose Content-Length promises
            // more than arrived (RFC 3261 §18.3); TCP and TLS framing wait for the bytes, so
            // their messages never get here incomplete.
            (Origin::Client { .. }, sip::ScanError::Incomplete) => Reply::BAD_REQUEST,
            _ => {
                bump(&self.counters.malformed);
                return Action::Drop(DropReason::Malformed);
            }
        };
        match sip::scan_for_reply(buf) {
            Ok(msg) if msg.is_request() && msg.via_header().is_some() => {
                bump(&self.counters.requests_in);
                self.reply(&msg, src, &reply, out)
            }
            _ => {
                bump(&self.counters.malformed);
                Action::Drop(DropReason::Malformed)
            }
        }
    }

    /// A stream message longer than the frame limit (RFC 3261 §18.3): `head` is what is
    /// buffered of it, at most the limit. Counted, and answered as
    /// [`SipCore::refuse_too_large`] says when the whole header section is in `head`; a
    /// header section cut at the limit may hide Via values the answer must copy (RFC 3261
    /// §8.2.6.2), so that message is dropped. Either way the shell then closes the
    /// connection: framing is lost (docs/sip.md, SIP over TCP).
    pub fn too_large(
        &self,
        head: &[u8],
        origin: Origin,
        src: SocketAddr,
        out: &mut Vec<u8>,
    ) -> Action {
        out.clear();
        bump(&self.counters.over_size_limit);
        self.refuse_too_large(head, origin, src, out)
    }

    /// A message past one of fulcrum's limits: more header lines than the scanner reads
    /// ([`sip::MAX_HEADERS`]) or, on a stream, more bytes than a frame may have. A client's
    /// request is answered 513 Message Too Large (RFC 3261 §21.5.14) when a lenient scan of
    /// `buf` ([`sip::scan_for_reply`], bounded by `buf`) finds the Via, Call-ID, CSeq, From and
    /// To the answer copies (§8.2.6.2); without them the client could not match it, and
    /// without a Via it could not even be sent. The rest, and every response or service's
    /// request, is dropped as malformed, as before the limits were answered.
    ///
    /// 513 for too many header lines too, not 400: the request is not malformed, only longer
    /// than fulcrum takes, and its line limit is a size limit counted in lines. It is the
    /// answer fulcrum already gives a request whose forwarded form would pass the same limit,
    /// and a client (or the looping proxy that stacked the Vias) should learn "too large", not
    /// that its syntax is wrong. In or outside a dialog alike: a 513 ends no dialog (RFC 3261
    /// §12.2.1.2), and silence would only make the client retransmit for 32 s.
    fn refuse_too_large(
        &self,
        buf: &[u8],
        origin: Origin,
        src: SocketAddr,
        out: &mut Vec<u8>,
    ) -> Action {
        if matches!(origin, Origin::Client { .. })
            && let Ok(msg) = sip::scan_for_reply(buf)
            && msg.is_request()
            && msg.missing_mandatory().is_none()
        {
            bump(&self.counters.requests_in);
            return self.reply(&msg, src, &Reply::MESSAGE_TOO_LARGE, out);
        }
        bump(&self.counters.malformed);
        Action::Drop(DropReason::Malformed)
    }

    /// A stateless reply to the request's sender (RFC 3261 §8.2.6, RFC 3581 §4).
    pub(super) fn reply(
        &self,
        msg: &SipMsg<'_>,
        src: SocketAddr,
        reply: &Reply<'_>,
        out: &mut Vec<u8>,
    ) -> Action {
        out.clear();
        match build_reply(msg, reply, src, out) {
            Ok(()) => {
                // Counted once it exists: an ACK is never answered, a 400 that cannot be
                // built is counted as malformed instead.
                match reply.code {
                    400 => bump(&self.counters.replies_400),
                    505 => bump(&self.counters.replies_505),
                    420 => bump(&self.counters.replies_420),
                    501 => bump(&self.counters.replies_501),
                    483 => bump(&self.counters.replies_483),
                    513 => bump(&self.counters.replies_513),
                    503 => bump(&self.counters.replies_503),
                    _ => {}
                }
                Action::Reply(reply_target(msg, src))
            }
            Err(RewriteError::AckNotAnswered) => {
                bump(&self.counters.acks_not_forwarded);
                Action::Drop(DropReason::AckNotForwarded)
            }
            Err(_) => {
                bump(&self.counters.malformed);
                Action::Drop(DropReason::Malformed)
            }
        }
    }

    pub(super) fn request_from_client(
        &self,
        msg: &SipMsg<'_>,
        src: SocketAddr,
        dst: SocketAddr,
        conn: Option<u64>,
        now: Nanos,
        out: &mut Vec<u8>,
    ) -> Action {
        // RFC 3261 §16.3 in its order: syntax (step 1), Max-Forwards (step 3), Proxy-Require
        // (step 5). Max-Forwards before anything is chosen: a looping request must not pin a
        // dialog or take a slot.
        if let Some(reply) = request_syntax_error(msg) {
            return self.reply(msg, src, &reply, out);
        }
        let max_forwards = msg.max_forwards();
        match max_forwards {
            MaxForwards::Value(0) => return self.reply(msg, src, &Reply::TOO_MANY_HOPS, out),
            MaxForwards::Bad => return self.reply(msg, src, &Reply::BAD_REQUEST, out),
            MaxForwards::Absent | MaxForwards::Value(_) => {}
        }
        // fulcrum supports no option tag, so any Proxy-Require is refused (RFC 3261 §16.3
        // step 5, which §16.11 keeps for stateless proxies; RFC 4475 §3.3.5).
        if msg.proxy_require().is_some() {
            return self.reply(msg, src, &Reply::BAD_EXTENSION, out);
        }
        // A datagram that cannot grow by fulcrum's Via, Record-Route and received / rport
        // without passing the largest UDP payload could not be sent on (RFC 3261 §21.5.14).
        // Both limits are checked before a member is chosen (and the dialog pinned and
        // counted there), so a refusal leaves nothing behind; `forward_request` checks the
        // lines again as its own invariant.
        if msg.len() > self.max_forwarded().saturating_sub(MAX_GROWTH)
            || !self.fits_lines(msg, max_forwards)
        {
            return self.reply(msg, src, &Reply::MESSAGE_TOO_LARGE, out);
        }
        if self.edge.has_flood()
            && self.is_new_flow(msg, now)
            && !self.edge.admits_new(src.ip(), now)
        {
            return Action::Drop(DropReason::Flood);
        }
        // The ACK of fulcrum's own final answer (a rule's refusal, a 503) ends here: the
        // request it acknowledges never reached a service.
        if sip::acks_own_reply(msg) {
            out.clear();
            return Action::Drop(DropReason::Absorbed);
        }
        let member = match self.choose_routed(msg, src, dst, now) {
            Ok(Some(m)) => m,
            Ok(None) => {
                return self.reply(msg, src, &Reply::service_unavailable(RETRY_AFTER_S), out);
            }
            // A rule's refusal, decided before anything is held or pinned: fulcrum's own
            // final answer (a retransmission gets it again, the ACK of it is absorbed), or
            // nothing at all.
            Err(Target::Reject { code, reason }) => {
                let reply = Reply {
                    code: *code,
                    reason,
                    retry_after_s: None,
                };
                return self.reply(msg, src, &reply, out);
            }
            Err(_) => {
                out.clear();
                return Action::Drop(DropReason::Routed);
            }
        };
        if member >= self.member_addrs.len() {
            return Action::Drop(DropReason::Unroutable);
        }
        // Toward a member on another transport: that leg's Via, and its Record-Route on top
        // of the client leg's (RFC 5658 §3.2).
        let leg = self.leg_of(member);
        let (token, with_path, in_record_route) = self.flow_token_of(msg, src, conn);
        let token = token.as_ref().map(sip::flow::Token::as_bytes);
        let rw = RequestRewrite {
            local: self.identity_toward(member),
            src,
            record_route: self.record_route,
            force_rport: false,
            conn_id: conn,
            service: self.digest_of(Some(member)),
            arrived_on: leg.map(|_| &self.local),
            flow: token.filter(|_| in_record_route),
            path: token.filter(|_| with_path),
        };
        match forward_request(msg, &rw, out) {
            Ok(n) if n > self.max_forwarded() => {
                self.reply(msg, src, &Reply::MESSAGE_TOO_LARGE, out)
            }
            // Fits the client's leg but not the member's: a stream client's request toward a
            // sip-udp member, longer than a datagram carries (RFC 3261 §21.5.14). The dialog
            // an initial request pinned in `choose` is let go (its retransmissions are
            // refused alike); an in-dialog request keeps its dialog.
            Ok(n) if n > self.max_forwarded_to(member) => {
                if msg.to_tag().is_none()
                    && let Some(h) = msg.call_id().map(hash::key_hash)
                {
                    self.end_dialog(h, now / 1_000_000);
                }
                self.reply(msg, src, &Reply::MESSAGE_TOO_LARGE, out)
            }
            Ok(_) => {
                bump(&self.counters.requests_forwarded);
                if with_path && token.is_some() {
                    bump(&self.counters.paths_added);
                }
                if let Some(c) = self.balancer.counters(member) {
                    c.record_request();
                }
                Action::ToMember(member)
            }
            Err(RewriteError::TooManyHops) => self.reply(msg, src, &Reply::TOO_MANY_HOPS, out),
            Err(RewriteError::TooManyHeaders) => {
                self.reply(msg, src, &Reply::MESSAGE_TOO_LARGE, out)
            }
            Err(_) => self.reply(msg, src, &Reply::BAD_REQUEST, out),
        }
    }

    /// Whether the forwarded request keeps within what fulcrum's scanner takes: the lines
    /// [`forward_request`] adds (its Via, Record-Route when on, Max-Forwards when absent).
    pub(super) fn fits_lines(&self, msg: &SipMsg<'_>, max_forwards: MaxForwards) -> bool {
        // Checked before a member is chosen: a bridge may record-route twice.
        let rr_lines = usize::from(self.record_route) * (1 + usize::from(!self.legs.is_empty()));
        let path = usize::from(msg.method_kind() == SipMethod::Register && self.flows.is_some());
        let added = 1 + rr_lines + path + usize::from(max_forwards == MaxForwards::Absent);
        msg.header_count() + added <= sip::MAX_HEADERS
    }

    /// The largest request fulcrum forwards: one it could take back itself, so that the
    /// answer (carrying the same headers) passes it again. On datagrams the largest UDP
    /// payload; on streams the frame limit of a client connection, the smaller of fulcrum's
    /// two ([`crate::sip::DEFAULT_MAX_MESSAGE`]).
    pub(super) fn max_forwarded(&self) -> usize {
        match self.local.transport() {
            sip::Transport::Udp => MAX_UDP_PAYLOAD,
            _ => sip::DEFAULT_MAX_MESSAGE,
        }
    }

    /// The longest request that can be forwarded to `member` over its leg: a datagram's
    /// payload toward a sip-udp member, whatever the client's transport.
    pub(super) fn max_forwarded_to(&self, member: usize) -> usize {
        match self.member_transport(member) {
            sip::Transport::Udp => MAX_UDP_PAYLOAD,
            _ => self.max_forwarded(),
        }
    }

    /// Choose again for a request already rewritten for a member whose connection failed
    /// (streams): the failed member is no longer usable, so dialog affinity and the method
    /// pass it over and the next-ranked member takes the request. The client's address for
    /// source-based methods is read from the request's second Via (`received`, else
    /// sent-by), since the first is fulcrum's own. Returns the member, or `None` when the
    /// bytes are not a request or no member can take it.
    pub fn rechoose(&self, forwarded: &[u8], dst: SocketAddr, now: Nanos) -> Option<usize> {
        let msg = sip::scan(forwarded).ok()?;
        if !msg.is_request() {
            return None;
        }
        let client = msg.vias().nth(1).and_then(|v| {
            let ip = v
                .received
                .and_then(|r| std::str::from_utf8(r).ok()?.parse().ok())
                .or_else(|| v.host_ip())?;
            Some(SocketAddr::new(ip, v.port.unwrap_or(5060)))
        });
        self.choose(&msg, client.unwrap_or(dst), dst, now)
    }

    /// fulcrum's 503 for a request it had already forwarded (`forwarded` carries its own Via
    /// on top) and can no longer deliver (streams: its member's connection failed and no
    /// other member can take it). Built as a service would answer it, then routed back like
    /// any response (to the client connection named in that Via), so the client learns at
    /// once instead of waiting for its transaction timer (RFC 3261 §16.7 step 6 lets a
    /// proxy answer 503 when it cannot forward). ACKs are not answered.
    /// The pending entry of the request ends with the 503 as with a service's answer.
    pub fn unavailable(&self, forwarded: &[u8], now: Nanos, out: &mut Vec<u8>) -> Action {
        let reply = Reply::service_unavailable(RETRY_AFTER_S);
        self.answer_forwarded(forwarded, &reply, out, |answer, out| {
            bump(&self.counters.replies_503);
            // fulcrum's own reply, built from its own Via: as trusted as a service's.
            let action = self.response(answer, true, out);
            self.track_answer(answer, Answerer::Unknown, now);
            action
        })
    }

    /// fulcrum's own `reply` to a request it had forwarded (`forwarded` carries its Via on
    /// top), built as the next hop would answer it and handed to `route` to go back like any
    /// response. ACKs are not answered.
    fn answer_forwarded(
        &self,
        forwarded: &[u8],
        reply: &Reply<'_>,
        out: &mut Vec<u8>,
        route: impl FnOnce(&SipMsg<'_>, &mut Vec<u8>) -> Action,
    ) -> Action {
        out.clear();
        let Ok(msg) = sip::scan(forwarded) else {
            return Action::Drop(DropReason::Malformed);
        };
        let mut resp = Vec::new();
        match build_response(&msg, reply, &mut resp) {
            Ok(()) => {}
            Err(RewriteError::AckNotAnswered) => return Action::Drop(DropReason::AckNotForwarded),
            Err(_) => return Action::Drop(DropReason::Malformed),
        }
        match sip::scan(&resp) {
            Ok(answer) => route(&answer, out),
            Err(_) => Action::Drop(DropReason::Malformed),
        }
    }

    /// The key of pool `pool`'s method and hash parameters (a rule's pool may have its own)
    /// for a request.
    pub(super) fn key_in(
        &self,
        pool: usize,
        msg: &SipMsg<'_>,
        src: SocketAddr,
        dst: SocketAddr,
        call_hash: Option<u64>,
    ) -> KeyInput {
        let (method, params) = match pool {
            0 => (self.method, &self.hash_params),
            p => (self.balancer.pool_method(p), self.balancer.pool_hash(p)),
        };
        request_key(method, params, msg, (src, dst), call_hash)
    }

    pub(super) fn choose(
        &self,
        msg: &SipMsg<'_>,
        src: SocketAddr,
        dst: SocketAddr,
        now: Nanos,
    ) -> Option<usize> {
        self.choose_routed(msg, src, dst, now).ok().flatten()
    }

    /// What the routing rules decide for `msg`: the rule that held (`None`: the default) and
    /// its target. `None` without rules, or where they do not apply (the vserver's own pool,
    /// uncounted).
    pub(super) fn pool_of(
        &self,
        msg: &SipMsg<'_>,
        src: SocketAddr,
        dst: SocketAddr,
    ) -> Option<(Option<usize>, &Target)> {
        let routes = self.balancer.routes()?;
        if !self.routes_apply(msg) {
            return None;
        }
        let mut req = crate::route::Request::new(msg, src, dst);
        let d = routes.decide(&mut req);
        Some((d.rule, d.target))
    }

    /// Whether rules route `msg`: a request other than ACK and CANCEL, and not one of a dialog
    /// (a To tag with fulcrum's Route: it follows its dialog even when this instance does not
    /// know it). A To tag alone does not skip the rules, so a scanner cannot pass a `drop` by
    /// adding one.
    fn routes_apply(&self, msg: &SipMsg<'_>) -> bool {
        crate::route::applies_to(msg)
            && !(msg.to_tag().is_some() && sip::routed_service(msg, &self.local).is_some())
    }

    /// Count what a rule (`None`: the default) decided.
    fn count_route(&self, rule: Option<usize>, target: &Target) {
        self.balancer.count_route(rule, target);
    }

    /// [`SipCore::choose`] with the routing rules' refusal: `Err` when a rule (or the
    /// default) rejects or drops `msg`, `Ok(None)` when its pool has no member for it.
    /// Affinity first (fulcrum's Record-Route, then the dialog table): a request of a dialog,
    /// and an INVITE sent again with credentials after a 401/407, reach the service that has
    /// the dialog whatever the rules say.
    pub(super) fn choose_routed(
        &self,
        msg: &SipMsg<'_>,
        src: SocketAddr,
        dst: SocketAddr,
        now: Nanos,
    ) -> Result<Option<usize>, &Target> {
        let now_ms = now / 1_000_000;
        // The scanner hands out the Call-ID without surrounding LWS, so this is also exactly the
        // call_id_hash key: hashed once, used for both.
        let call_hash = msg.call_id().map(hash::key_hash);
        if let Some(h) = call_hash {
            self.pull(h, now_ms);
        }
        // The dialog's service named by our Record-Route (`fc-svc`), whichever instance set
        // the dialog up: before the local table, which may not know the dialog.
        if let Some(m) = self.routed_member(msg) {
            self.balancer.count_affinity();
            bump(&self.counters.routed_by_record_route);
            if let Some(h) = call_hash {
                if ends_dialog(msg) {
                    self.end_dialog(h, now_ms);
                } else {
                    // The local pin (if this instance set the dialog up) stays fresh: a call
                    // longer than the idle timeout must not be swept, and uncounted, while up.
                    let _ = self.dialogs.get(h, now_ms);
                }
            }
            return Ok(Some(m));
        }
        // A REGISTER's pin depends on its pool's method (`aor_hash` pins none), so the rules
        // decide it before the table is asked.
        let early = (self.balancer.routes().is_some() && msg.method_kind() == SipMethod::Register)
            .then(|| self.pool_of(msg, src, dst));
        let method = match early {
            Some(Some((_, Target::Pool(p)))) => self.balancer.pool_method(*p),
            _ => self.method,
        };
        // A request that pins finds its Call-ID's entry through `get_pinning`: a new request
        // (a new CSeq) on an entry whose request was refused, an INVITE sent again with
        // credentials, makes it pending again.
        let cseq = msg.cseq().map_or(0, |c| c.seq);
        let pinning = pins_with(method, msg) && msg.to_tag().is_none();
        let pinned = call_hash.and_then(|h| {
            if pinning {
                self.dialogs.get_pinning(h, cseq, now_ms, |c| self.tally(c))
            } else {
                self.dialogs.get(h, now_ms)
            }
        });
        if let Some(h) = call_hash
            && let Some(m) = pinned
            && self.balancer.accepts_existing(m as usize)
        {
            self.balancer.count_affinity();
            if ends_dialog(msg) {
                self.end_dialog(h, now_ms);
            }
            return Ok(Some(m as usize));
        }
        let decided = early.unwrap_or_else(|| self.pool_of(msg, src, dst));
        let pool = match decided {
            None => 0,
            Some((rule, t)) => {
                self.count_route(rule, t);
                match t {
                    Target::Pool(p) => *p,
                    refusal => return Err(refusal),
                }
            }
        };
        let method = self.balancer.pool_method(pool);
        let key = self.key_in(pool, msg, src, dst, call_hash);
        let Some(choice) = self.balancer.choose_in(pool, key, now, &|_| false) else {
            if let Some((rule, _)) = decided {
                self.balancer.count_route_unavailable(rule);
            }
            return Ok(None);
        };
        let member = choice.member as u32;
        // A BYE (or CANCEL) of a dialog whose member no longer takes it (DOWN) goes elsewhere,
        // and still ends the dialog: its member stops counting it now, not at the idle timeout.
        if let Some(h) = call_hash
            && ends_dialog(msg)
        {
            self.end_dialog(h, now_ms);
        }
        match call_hash {
            Some(h) if pins_with(method, msg) => self.pin(h, member, cseq, now_ms),
            // No dialog: only its retransmissions follow it (a MESSAGE delivered twice by two
            // services would be a duplicate the user sees), uncounted. An ACK has none.
            Some(h) if msg.method_kind() != SipMethod::Ack => {
                self.dialogs.linger(h, member, now_ms, |c| self.tally(c));
            }
            _ => {}
        }
        Ok(Some(choice.member))
    }

    /// A request from a service toward a client (in-dialog: BYE, re-INVITE, NOTIFY...):
    /// routed by Route / Request-URI, never to ourselves.
    pub(super) fn request_from_service(
        &self,
        msg: &SipMsg<'_>,
        member: usize,
        src: SocketAddr,
        now: Nanos,
        out: &mut Vec<u8>,
    ) -> Action {
        bump(&self.counters.in_dialog_from_services);
        // The service hanging up ends the dialog as the client's BYE would.
        if ends_dialog(msg)
            && let Some(h) = msg.call_id().map(hash::key_hash)
        {
            self.end_dialog(h, now / 1_000_000);
        }
        // A flow token in fulcrum's own Route: the client's flow, whatever the Request-URI.
        let flow_token = self.flows.as_ref().zip(sip::routed_flow(msg, &self.local));
        if let Some((keys, token)) = flow_token {
            return self.request_to_flow(msg, member, src, keys.verify(token, now), token, out);
        }
        let target = match request_target(msg, &self.local) {
            Ok(t) => t,
            Err(RewriteError::Loop) => {
                bump(&self.counters.loops);
                return Action::Drop(DropReason::Loop);
            }
            Err(_) => {
                bump(&self.counters.unroutable);
                return Action::Drop(DropReason::Unroutable);
            }
        };
        let Some(addr) = target.socket_addr() else {
            bump(&self.counters.unroutable);
            return Action::Drop(DropReason::Unroutable);
        };
        if self.local.is_local_addr(addr) {
            bump(&self.counters.loops);
            return Action::Drop(DropReason::Loop);
        }
        self.toward_client(msg, member, src, None, Action::ToAddr(addr), out)
    }

    /// A service's request rewritten toward a client and sent as `to` says: it leaves on the
    /// client leg (the vserver's own transport); from a member on another transport it is
    /// double record-routed, the client leg's entry on top, carrying `flow` (a flow token)
    /// when the request sets up a dialog.
    fn toward_client(
        &self,
        msg: &SipMsg<'_>,
        member: usize,
        src: SocketAddr,
        flow: Option<&[u8]>,
        to: Action,
        out: &mut Vec<u8>,
    ) -> Action {
        let rw = RequestRewrite {
            local: &self.local,
            src,
            record_route: self.record_route,
            force_rport: false,
            conn_id: None,
            service: self.digest_of(Some(member)),
            arrived_on: self.leg_of(member),
            flow: flow.filter(|_| self.record_route && pins_dialog(msg)),
            path: None,
        };
        match forward_request(msg, &rw, out) {
            Ok(n) if n > self.max_forwarded() => {
                self.reply(msg, src, &Reply::MESSAGE_TOO_LARGE, out)
            }
            Ok(_) => {
                bump(&self.counters.requests_forwarded);
                if flow.is_some() {
                    bump(&self.counters.routed_by_flow);
                }
                to
            }
            Err(RewriteError::TooManyHops) => self.reply(msg, src, &Reply::TOO_MANY_HOPS, out),
            Err(RewriteError::TooManyHeaders) => {
                self.reply(msg, src, &Reply::MESSAGE_TOO_LARGE, out)
            }
            Err(_) => {
                bump(&self.counters.malformed);
                Action::Drop(DropReason::Malformed)
            }
        }
    }

    /// Whether `bytes`, a client's message on a stream, is a REGISTER that fulcrum forwards
    /// with a Path naming the client's flow: its connection then carries a registration and
    /// is evicted last (docs/limits.md). Only a REGISTER is scanned (rare next to the rest).
    pub fn registers_flow(&self, bytes: &[u8]) -> bool {
        bytes.starts_with(b"REGISTER ")
            && sip::scan(bytes).is_ok_and(|m| self.flow_token_wanted(&m).0)
    }

    /// The flow token a client's request from `src` (over connection `conn`) carries, and
    /// where: (token, in a Path, in its Record-Route). Every failover attempt of a held
    /// request carries the same as its first.
    pub(super) fn flow_token_of(
        &self,
        msg: &SipMsg<'_>,
        src: SocketAddr,
        conn: Option<u64>,
    ) -> (Option<sip::flow::Token>, bool, bool) {
        let (with_path, in_record_route) = self.flow_token_wanted(msg);
        let token = (with_path || in_record_route)
            .then(|| {
                let keys = self.flows.as_ref()?;
                Some(keys.sign(self.local.transport(), src, conn))
            })
            .flatten();
        (token, with_path, in_record_route)
    }

    /// Whether a client's request gets a flow token: (in a Path, in its Record-Route). A
    /// REGISTER gets a Path when the vserver's `path` says so (`auto`: when it says
    /// `Supported: path`, RFC 3327 §5.2); a request that sets up a dialog carries the token
    /// in its Record-Route (when that is on), so the dialog's requests toward the client
    /// reach it over its flow. `path: off` turns both off.
    fn flow_token_wanted(&self, msg: &SipMsg<'_>) -> (bool, bool) {
        use crate::config::PathMode;
        if self.flows.is_none() || self.path == PathMode::Off || msg.to_tag().is_some() {
            return (false, false);
        }
        match msg.method_kind() {
            SipMethod::Register => (
                self.path == PathMode::Always || msg.supports(b"path"),
                false,
            ),
            _ => (false, self.record_route && pins_dialog(msg)),
        }
    }

    /// A service's request whose top Route is fulcrum's with a flow token (`verified`: what
    /// the vserver's keys say of it): to that flow (the client's address on UDP, its
    /// connection on a stream), with the token kept in the Record-Route of the dialog it may
    /// set up. A token fulcrum did not make for this vserver is answered 403; a flow this
    /// vserver cannot reach (a stream of another start, another transport, a token of the
    /// previous form past its hour) 430 Flow Failed (RFC 5626 §5.3).
    fn request_to_flow(
        &self,
        msg: &SipMsg<'_>,
        member: usize,
        src: SocketAddr,
        verified: Result<sip::flow::Flow, sip::flow::FlowError>,
        token: &[u8],
        out: &mut Vec<u8>,
    ) -> Action {
        use sip::flow::FlowError;
        let flow = match verified {
            Ok(f) if f.transport == self.local.transport() => f,
            Ok(_) | Err(FlowError::Gone) => {
                bump(&self.counters.flow_failed);
                return self.reply(msg, src, &Reply::FLOW_FAILED, out);
            }
            Err(FlowError::Forged) => {
                bump(&self.counters.flow_forged);
                return self.reply(msg, src, &Reply::FORBIDDEN, out);
            }
        };
        let to = match flow.conn {
            Some((id, _)) => Action::ToFlow(id),
            None => Action::ToAddr(flow.addr),
        };
        self.toward_client(msg, member, src, Some(token), to, out)
    }

    /// fulcrum's 430 Flow Failed (RFC 5626 §5.3) for a service's request it had forwarded
    /// toward a client connection that is gone (`forwarded` carries fulcrum's Via on top):
    /// built as the client would answer it and routed back to the service like any
    /// response. ACKs are not answered.
    pub fn flow_failed(&self, forwarded: &[u8], out: &mut Vec<u8>) -> Action {
        self.answer_forwarded(forwarded, &Reply::FLOW_FAILED, out, |answer, out| {
            bump(&self.counters.flow_failed);
            self.response(answer, true, out)
        })
    }
}

/// Whether `msg` pins its Call-ID to the member `method` chose for it: a request that sets up
/// a dialog, and a REGISTER (its refreshes reuse the Call-ID, RFC 3261 §10.2.4) unless the
/// method keys it by its address-of-record: `aor_hash` brings every refresh, and every call
/// to the AoR, to the registrar the AoR ranks first, back there too once it is usable again
/// after a failover; a pin would keep the refreshes on the registrar that took one over while
/// the calls went to the first.
pub(super) fn pins_with(method: Method, msg: &SipMsg<'_>) -> bool {
    pins_dialog(msg) && !(method == Method::AorHash && msg.method_kind() == SipMethod::Register)
}

/// The key `method` takes from a SIP request with hash parameters `params`, from `src` to
/// `dst`; `call_hash` is the Call-ID's hash when the caller has it (the `call_id_hash` key,
/// hashed once for the dialog table too).
pub fn request_key(
    method: Method,
    params: &crate::config::HashParams,
    msg: &SipMsg<'_>,
    (src, dst): (SocketAddr, SocketAddr),
    call_hash: Option<u64>,
) -> KeyInput {
    let ctx = RequestCtx {
        src,
        dst,
        payload: Payload::Sip(msg),
    };
    match (method, call_hash) {
        (Method::CallIdHash, Some(h)) => KeyInput::Hash(h),
        _ => match key::extract(method, params, &ctx) {
            KeyOutcome::Key(k) => KeyInput::Hash(hash::key_hash(k.as_bytes())),
            KeyOutcome::NoKey => KeyInput::NoKey,
            KeyOutcome::Unparseable => KeyInput::Unparseable,
        },
    }
}
