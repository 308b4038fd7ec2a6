//! PURE: responses: a service's response relayed to the next Via, and only a service's
//! anywhere (RFC 3261 §16.7, docs/sip.md "Never an open relay").

use super::*;

impl SipCore {
    /// Whether a response routed by `route` goes to the host of a member (not to a client
    /// connection, and not to a name).
    pub(super) fn is_member_host(&self, route: &sip::ResponseRoute<'_>) -> bool {
        route.conn_id.is_none()
            && route
                .target
                .socket_addr()
                .is_some_and(|a| self.is_member_ip(a))
    }

    /// A response: fulcrum's Via must be on top; it is removed and the response goes to
    /// the next Via (received / rport aware).
    ///
    /// Only a service's response may go anywhere its next Via says. A response from anyone
    /// else can only answer a request a service sent through fulcrum (an in-dialog BYE
    /// toward a client, say), so it may go only to a service's host: fulcrum's Via is easy
    /// to forge, and honouring a forged one would relay arbitrary datagrams to any address
    /// or inject them into another client's connection (docs/sip.md, Never an open relay).
    pub(super) fn response(
        &self,
        msg: &SipMsg<'_>,
        from_member: bool,
        out: &mut Vec<u8>,
    ) -> Action {
        match forward_response(msg, &self.local, out) {
            Ok(route) if !from_member && !self.is_member_host(&route) => {
                out.clear();
                bump(&self.counters.not_ours);
                Action::Drop(DropReason::NotOurs)
            }
            Ok(route) => match route.target.socket_addr() {
                // Streams: the client connection named in our Via carries the response.
                _ if route.conn_id.is_some() => {
                    bump(&self.counters.responses_forwarded);
                    route
                        .conn_id
                        .map_or(Action::Drop(DropReason::Unroutable), Action::ToConn)
                }
                Some(addr) if self.local.is_local_addr(addr) => {
                    bump(&self.counters.loops);
                    Action::Drop(DropReason::Loop)
                }
                Some(addr) => {
                    bump(&self.counters.responses_forwarded);
                    Action::ToAddr(addr)
                }
                None => {
                    bump(&self.counters.unroutable);
                    Action::Drop(DropReason::Unroutable)
                }
            },
            Err(RewriteError::ViaNotOurs) => {
                bump(&self.counters.not_ours);
                Action::Drop(DropReason::NotOurs)
            }
            Err(_) => {
                bump(&self.counters.malformed);
                Action::Drop(DropReason::Malformed)
            }
        }
    }
}
