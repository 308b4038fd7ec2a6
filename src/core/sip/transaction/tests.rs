//! The failover machine in simulated time, with a core stand-in that records what it built.

use super::*;
use std::cell::RefCell;
use std::time::Duration;

const S: Nanos = 1_000_000_000;

/// Members at 127.0.0.1:7001.. ranked in order; `down` members are never chosen, `streams`
/// members are reached over a stream (the others over UDP).
struct Core {
    members: usize,
    down: Vec<usize>,
    streams: Vec<usize>,
    forwarded: RefCell<Vec<(u8, usize)>>,
}

impl Core {
    fn new(members: usize) -> Core {
        Core {
            members,
            down: Vec::new(),
            streams: Vec::new(),
            forwarded: RefCell::new(Vec::new()),
        }
    }

    fn hop(&self, m: usize, sent: Bytes) -> Hop {
        Hop {
            member: m,
            addr: addr(m),
            sent,
            datagram: !self.streams.contains(&m),
        }
    }
}

fn addr(m: usize) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 7001 + m as u16))
}

impl Hops for Core {
    fn forward(&self, attempt: u8, tried: &[SocketAddr]) -> Option<Hop> {
        let m =
            (0..self.members).find(|&m| !tried.contains(&addr(m)) && !self.down.contains(&m))?;
        self.forwarded.borrow_mut().push((attempt, m));
        Some(self.hop(m, Bytes::from(format!("INVITE attempt {attempt} to {m}"))))
    }

    fn reply(&self, code: u16) -> Option<Bytes> {
        Some(Bytes::from(format!("SIP/2.0 {code} by fulcrum")))
    }

    fn hop(&self, sent: &[u8], method: &[u8], response: Option<&[u8]>) -> Option<Bytes> {
        let mut v = method.to_vec();
        v.extend_from_slice(b" of ");
        v.extend_from_slice(sent);
        if let Some(r) = response {
            v.extend_from_slice(b" for ");
            v.extend_from_slice(r);
        }
        Some(Bytes::from(v))
    }

    fn relay(&self, response: &[u8]) -> Option<Bytes> {
        let mut v = b"relayed ".to_vec();
        v.extend_from_slice(response);
        Some(Bytes::from(v))
    }
}

/// The defaults, with `no_answer` at 1 s for round numbers.
fn params() -> Failover {
    Failover {
        no_answer: Duration::from_secs(1),
        ..Failover::default()
    }
}

fn start(core: &Core, invite: bool) -> (Transaction, Vec<TxAction>) {
    let mut out = Vec::new();
    let sent = Bytes::from_static(b"INVITE attempt 0 to 0");
    let tx = Transaction::start(
        0,
        invite,
        true,
        &params(),
        core.hop(0, sent),
        core,
        &mut out,
    );
    (tx, out)
}

fn respond(tx: &mut Transaction, core: &Core, now: Nanos, attempt: u8, code: u16) -> Vec<TxAction> {
    let mut out = Vec::new();
    let text = format!("SIP/2.0 {code} from attempt {attempt}");
    let ev = Event::Response {
        attempt,
        code,
        retry_after_s: (code == 503).then_some(30),
        bytes: text.as_bytes(),
    };
    tx.handle(now, ev, core, &mut out);
    out
}

fn at(tx: &mut Transaction, core: &Core, now: Nanos, ev: Event<'_>) -> Vec<TxAction> {
    let mut out = Vec::new();
    tx.handle(now, ev, core, &mut out);
    out
}

fn to_client(out: &[TxAction]) -> Vec<String> {
    out.iter()
        .filter_map(|a| match a {
            TxAction::ToClient(b) | TxAction::Resend(b) => {
                Some(String::from_utf8_lossy(b).into_owned())
            }
            TxAction::Relay => Some("relay".to_owned()),
            _ => None,
        })
        .collect()
}

fn to_members(out: &[TxAction]) -> Vec<(u16, String)> {
    out.iter()
        .filter_map(|a| match a {
            TxAction::ToMember(a, b) => {
                Some((a.port() - 7001, String::from_utf8_lossy(b).into_owned()))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn an_invite_gets_100_at_once_and_a_503_moves_it_to_the_next_service_unseen() {
    let core = Core::new(3);
    let (mut tx, out) = start(&core, true);
    assert_eq!(to_client(&out), ["SIP/2.0 100 by fulcrum"]);
    let out = respond(&mut tx, &core, S / 10, 0, 503);
    assert_eq!(
        to_client(&out),
        Vec::<String>::new(),
        "the 503 is not relayed"
    );
    let sent = to_members(&out);
    assert_eq!(sent[0].0, 0);
    assert!(sent[0].1.starts_with("ACK of INVITE attempt 0"), "{sent:?}");
    assert_eq!(sent[1], (1, "INVITE attempt 1 to 1".to_owned()));
    assert!(out.contains(&TxAction::Failed {
        addr: addr(0),
        code: Some(503),
        retry_after_s: Some(30)
    }));
    let out = respond(&mut tx, &core, S / 5, 1, 180);
    assert_eq!(to_client(&out), ["relay"]);
    let out = respond(&mut tx, &core, S / 4, 1, 200);
    assert_eq!(to_client(&out), ["relay"]);
    assert!(
        to_members(&out).is_empty(),
        "a 2xx is acknowledged end to end"
    );
    assert!(tx.is_answered());
    assert!(!tx.is_finished(S));
    assert!(tx.is_finished(S / 4 + TIMER_64T1));
}

#[test]
fn an_attempt_that_never_answers_is_retransmitted_then_left_after_no_answer() {
    let core = Core::new(3);
    let (mut tx, _) = start(&core, true);
    assert_eq!(tx.poll_timeout(), Some(T1));
    let out = at(&mut tx, &core, T1, Event::Timer);
    assert_eq!(to_members(&out), [(0, "INVITE attempt 0 to 0".to_owned())]);
    // Timer A doubles: next at 1.5 s, but no_answer (1 s) comes first.
    assert_eq!(tx.poll_timeout(), Some(S));
    let out = at(&mut tx, &core, S, Event::Timer);
    assert_eq!(to_members(&out), [(1, "INVITE attempt 1 to 1".to_owned())]);
    assert!(out.contains(&TxAction::Failed {
        addr: addr(0),
        code: None,
        retry_after_s: None
    }));
    // The abandoned attempt rings late: cancelled, not relayed.
    let out = respond(&mut tx, &core, S + S / 10, 0, 180);
    assert!(to_client(&out).is_empty());
    assert!(
        to_members(&out)[0]
            .1
            .starts_with("CANCEL of INVITE attempt 0")
    );
    // Its 487 is acknowledged and absorbed.
    let out = respond(&mut tx, &core, S + S / 5, 0, 487);
    assert!(to_client(&out).is_empty());
    assert!(to_members(&out)[0].1.starts_with("ACK of INVITE attempt 0"));
    let out = respond(&mut tx, &core, S + S / 2, 1, 200);
    assert_eq!(to_client(&out), ["relay"]);
}

/// Across the transports bridge one request tries members of both kinds: an attempt over a
/// stream is never retransmitted (the link is reliable), the next one over UDP is, by Timer
/// A from its own start, and each still ends at `no_answer`.
#[test]
fn only_attempts_toward_udp_members_are_retransmitted() {
    let mut core = Core::new(3);
    core.streams = vec![0];
    let (mut tx, _) = start(&core, true);
    // Over a stream, nothing is due before no_answer.
    assert_eq!(tx.poll_timeout(), Some(S));
    let out = at(&mut tx, &core, S, Event::Timer);
    assert_eq!(to_members(&out), [(1, "INVITE attempt 1 to 1".to_owned())]);
    // Member 1 is reached over UDP: Timer A runs from the attempt's start.
    assert_eq!(tx.poll_timeout(), Some(S + T1));
    let out = at(&mut tx, &core, S + T1, Event::Timer);
    assert_eq!(to_members(&out), [(1, "INVITE attempt 1 to 1".to_owned())]);
    let out = at(&mut tx, &core, 2 * S, Event::Timer);
    assert_eq!(to_members(&out), [(2, "INVITE attempt 2 to 2".to_owned())]);
}

#[test]
fn a_late_2xx_of_an_abandoned_attempt_is_still_relayed() {
    let core = Core::new(3);
    let (mut tx, _) = start(&core, true);
    at(&mut tx, &core, S, Event::Timer);
    let out = respond(&mut tx, &core, S + 1, 1, 200);
    assert_eq!(to_client(&out), ["relay"]);
    let out = respond(&mut tx, &core, S + 2, 0, 200);
    assert_eq!(
        to_client(&out),
        ["relay"],
        "§16.7 step 5: every 2xx goes upstream"
    );
}

#[test]
fn when_every_try_answers_503_the_client_gets_500() {
    let core = Core::new(5);
    let (mut tx, _) = start(&core, true);
    respond(&mut tx, &core, 1, 0, 503);
    respond(&mut tx, &core, 2, 1, 503);
    let out = respond(&mut tx, &core, 3, 2, 503);
    assert_eq!(to_client(&out), ["SIP/2.0 500 by fulcrum"]);
    assert_eq!(tx.attempts(), 3, "tries: 3");
    assert_eq!(core.forwarded.borrow().len(), 2);
}

#[test]
fn the_best_answer_is_relayed_when_the_tries_run_out() {
    let core = Core::new(5);
    let (mut tx, _) = start(&core, true);
    respond(&mut tx, &core, 1, 0, 503);
    respond(&mut tx, &core, 2, 1, 500);
    let out = respond(&mut tx, &core, 3, 2, 503);
    assert_eq!(to_client(&out), ["relayed SIP/2.0 500 from attempt 1"]);
}

#[test]
fn no_answer_anywhere_gets_408_and_no_member_left_ends_early() {
    let mut core = Core::new(3);
    core.down = vec![2];
    let (mut tx, _) = start(&core, true);
    at(&mut tx, &core, S, Event::Timer);
    let out = at(&mut tx, &core, 2 * S, Event::Timer);
    assert_eq!(to_client(&out), ["SIP/2.0 408 by fulcrum"]);
    assert_eq!(tx.attempts(), 2, "the third member is down");
}

#[test]
fn an_answer_outside_the_codes_goes_to_the_client_as_it_is() {
    let core = Core::new(3);
    let (mut tx, _) = start(&core, true);
    let out = respond(&mut tx, &core, 1, 0, 486);
    assert_eq!(to_client(&out), ["relay"]);
    assert!(to_members(&out)[0].1.starts_with("ACK of"));
    assert!(out.contains(&TxAction::Answered { addr: addr(0) }));
    assert_eq!(tx.attempts(), 1);
    // The client's ACK and a retransmitted 486 are absorbed.
    assert!(at(&mut tx, &core, 2, Event::Ack).is_empty());
    assert!(to_client(&respond(&mut tx, &core, 3, 0, 486)).is_empty());
}

#[test]
fn a_cancel_goes_to_the_attempt_once_it_rings() {
    let core = Core::new(3);
    let (mut tx, _) = start(&core, true);
    // Before any provisional answer: nothing sent yet (§9.1).
    assert!(to_members(&at(&mut tx, &core, 1, Event::Cancel)).is_empty());
    let out = respond(&mut tx, &core, 2, 0, 180);
    assert!(to_members(&out)[0].1.starts_with("CANCEL of"));
    assert!(
        to_client(&out).is_empty(),
        "a cancelled attempt's ringing is not relayed"
    );
    let out = respond(&mut tx, &core, 3, 0, 487);
    assert_eq!(to_client(&out), ["relay"]);
    assert!(to_members(&out)[0].1.starts_with("ACK of"));
}

/// fulcrum's CANCEL is a non-INVITE transaction of its own: toward a UDP member it is sent
/// again by Timer E (T1, 2·T1, ... capped at T2) until the member answers it; over a stream
/// never. The attempt's final answer ends it too.
#[test]
fn a_cancel_toward_a_udp_member_is_retransmitted_until_answered() {
    let cancels = |out: &[TxAction]| {
        to_members(out)
            .iter()
            .filter(|(_, b)| b.starts_with("CANCEL of"))
            .count()
    };
    let core = Core::new(3);
    let (mut tx, _) = start(&core, true);
    respond(&mut tx, &core, 1, 0, 180);
    assert_eq!(cancels(&at(&mut tx, &core, 2, Event::Cancel)), 1);
    assert_eq!(tx.poll_timeout(), Some(2 + T1));
    assert_eq!(cancels(&at(&mut tx, &core, 2 + T1, Event::Timer)), 1);
    assert_eq!(tx.poll_timeout(), Some(2 + 3 * T1));
    assert_eq!(cancels(&at(&mut tx, &core, 2 + 3 * T1, Event::Timer)), 1);
    // Its 200: no more.
    at(
        &mut tx,
        &core,
        2 + 3 * T1 + 1,
        Event::CancelAnswered { attempt: 0 },
    );
    while let Some(t) = tx.poll_timeout().filter(|&t| t < 20 * S) {
        assert_eq!(cancels(&at(&mut tx, &core, t, Event::Timer)), 0, "at {t}");
    }
    // Unanswered, it stops at the attempt's final answer.
    let (mut tx, _) = start(&core, true);
    respond(&mut tx, &core, 1, 0, 180);
    at(&mut tx, &core, 2, Event::Cancel);
    respond(&mut tx, &core, 3, 0, 487);
    while let Some(t) = tx.poll_timeout().filter(|&t| t < 20 * S) {
        assert_eq!(cancels(&at(&mut tx, &core, t, Event::Timer)), 0, "at {t}");
    }
    // Over a stream it is sent once.
    let mut core = Core::new(3);
    core.streams = vec![0];
    let (mut tx, _) = start(&core, true);
    respond(&mut tx, &core, 1, 0, 180);
    assert_eq!(cancels(&at(&mut tx, &core, 2, Event::Cancel)), 1);
    assert_eq!(tx.poll_timeout(), Some(1 + TIMER_C), "only Timer C is left");
}

#[test]
fn a_cancelled_invite_is_not_failed_over() {
    let core = Core::new(3);
    let (mut tx, _) = start(&core, true);
    at(&mut tx, &core, 1, Event::Cancel);
    let out = at(&mut tx, &core, S, Event::Timer);
    assert_eq!(to_client(&out), ["SIP/2.0 487 by fulcrum"]);
    assert_eq!(tx.attempts(), 1);
    let (mut tx, _) = start(&core, true);
    respond(&mut tx, &core, 1, 0, 180);
    let out = at(&mut tx, &core, 2, Event::Cancel);
    assert!(to_members(&out)[0].1.starts_with("CANCEL of"));
    // A failover code after the CANCEL: no next attempt, and a CANCELed request ends 487
    // (RFC 3261 §16.10), not with the best answer.
    let out = respond(&mut tx, &core, 3, 0, 503);
    assert_eq!(tx.attempts(), 1);
    assert_eq!(to_client(&out), ["SIP/2.0 487 by fulcrum"]);
}

#[test]
fn after_ringing_only_timer_c_ends_an_invite_attempt() {
    let core = Core::new(3);
    let (mut tx, _) = start(&core, true);
    respond(&mut tx, &core, 1, 0, 180);
    assert_eq!(tx.poll_timeout(), Some(1 + TIMER_C));
    assert!(at(&mut tx, &core, 10 * S, Event::Timer).is_empty());
    let out = at(&mut tx, &core, 1 + TIMER_C, Event::Timer);
    assert!(to_members(&out)[0].1.starts_with("CANCEL of"));
    assert_eq!(to_client(&out), ["SIP/2.0 408 by fulcrum"]);
}

#[test]
fn a_non_invite_gets_no_100_and_timer_e_stops_at_t2() {
    let core = Core::new(3);
    let mut p = params();
    p.no_answer_non_invite = Some(Duration::from_secs(20));
    let mut out = Vec::new();
    let first = core.hop(0, Bytes::from_static(b"MESSAGE"));
    let mut tx = Transaction::start(0, false, true, &p, first, &core, &mut out);
    assert!(to_client(&out).is_empty());
    let mut sends = Vec::new();
    let mut now = 0;
    while let Some(t) = tx.poll_timeout().filter(|&t| t < 20 * S) {
        now = t;
        let out = at(&mut tx, &core, now, Event::Timer);
        if !to_members(&out).is_empty() {
            sends.push(now);
        }
    }
    let gaps: Vec<Nanos> = sends.windows(2).map(|w| (w[1] - w[0]) / MS).collect();
    assert_eq!(sends[0], T1);
    assert_eq!(&gaps[..4], [1000, 2000, 4000, 4000]);
    assert!(now < 20 * S);
    let out = at(&mut tx, &core, 20 * S, Event::Timer);
    assert_eq!(to_members(&out), [(1, "INVITE attempt 1 to 1".to_owned())]);
}

#[test]
fn a_retransmitted_request_gets_the_last_answer_again() {
    let core = Core::new(3);
    let (mut tx, _) = start(&core, true);
    assert_eq!(
        to_client(&at(&mut tx, &core, 1, Event::Retransmission)),
        ["SIP/2.0 100 by fulcrum"]
    );
    respond(&mut tx, &core, 1, 0, 503);
    respond(&mut tx, &core, 2, 1, 503);
    respond(&mut tx, &core, 3, 2, 503);
    assert_eq!(
        to_client(&at(&mut tx, &core, 4, Event::Retransmission)),
        ["SIP/2.0 500 by fulcrum"]
    );
}

#[test]
fn the_failover_codes_are_a_set_of_final_answers() {
    let codes = Codes::of(&[500, 503, 504, 300, 699, 200, 700]);
    for c in [300, 500, 503, 504, 699] {
        assert!(codes.contains(c), "{c}");
    }
    for c in [0, 100, 200, 299, 301, 486, 501, 700, 65535] {
        assert!(!codes.contains(c), "{c}");
    }
}

#[test]
fn the_best_answer_is_the_lowest_class_and_503_last() {
    assert!(better(486, 503));
    assert!(better(500, 503));
    assert!(!better(503, 500));
    assert!(!better(503, 404));
    assert!(!better(504, 500));
}

/// What the shell does with a [`TxAction::Relay`] of a final answer: the bytes that left
/// are handed back, to be sent again.
fn respond_relayed(
    tx: &mut Transaction,
    core: &Core,
    now: Nanos,
    attempt: u8,
    code: u16,
) -> Vec<TxAction> {
    let out = respond(tx, core, now, attempt, code);
    if code >= 200 && out.contains(&TxAction::Relay) {
        tx.relayed(Bytes::from(format!(
            "relayed SIP/2.0 {code} from attempt {attempt}"
        )));
    }
    out
}

/// Every time a deadline passes until `until`, what went to the client.
fn run_until(tx: &mut Transaction, core: &Core, until: Nanos) -> Vec<(Nanos, String)> {
    let mut seen = Vec::new();
    while let Some(t) = tx
        .poll_timeout()
        .filter(|&t| t <= until && !tx.is_finished(t))
    {
        for c in to_client(&at(tx, core, t, Event::Timer)) {
            seen.push((t, c));
        }
    }
    seen
}

/// RFC 3261 §17.2.1: over UDP, a non-2xx final to an INVITE is sent again on Timer G (T1,
/// doubling, capped at T2) until the client's ACK; the ACK stops it and the transaction ends
/// T4 later (Timer I). This is what keeps a refused call from ringing for ever when one
/// datagram is lost: after its 100 the client does not retransmit.
#[test]
fn a_refusal_relayed_to_a_udp_client_is_retransmitted_on_timer_g_until_its_ack() {
    let core = Core::new(3);
    let (mut tx, _) = start(&core, true);
    let out = respond_relayed(&mut tx, &core, S, 0, 486);
    assert_eq!(to_client(&out), ["relay"]);
    let seen = run_until(&mut tx, &core, S + 8 * S);
    let times: Vec<Nanos> = seen.iter().map(|(t, _)| (t - S) / MS).collect();
    assert_eq!(
        times,
        [500, 1500, 3500, 7500],
        "T1, 2·T1, 4·T1, then T2 apart"
    );
    assert!(
        seen.iter()
            .all(|(_, b)| b == "relayed SIP/2.0 486 from attempt 0")
    );
    at(&mut tx, &core, 9 * S + 1, Event::Ack);
    assert!(
        run_until(&mut tx, &core, 60 * S).is_empty(),
        "the ACK stops Timer G"
    );
    assert!(tx.is_finished(9 * S + 1 + T4), "Timer I");
    assert_eq!(tx.final_code(), Some(486));
    assert!(tx.absorbs_ack());
}

/// Without an ACK, Timer H (64·T1 from the final) ends the retransmissions; fulcrum's own
/// finals (500 after every try answered 503) are retransmitted the same way.
#[test]
fn timer_h_ends_timer_g_and_own_finals_are_retransmitted_too() {
    let core = Core::new(3);
    let (mut tx, _) = start(&core, true);
    respond(&mut tx, &core, 1, 0, 503);
    respond(&mut tx, &core, 2, 1, 503);
    let out = respond(&mut tx, &core, 3, 2, 503);
    assert_eq!(to_client(&out), ["SIP/2.0 500 by fulcrum"]);
    let seen = run_until(&mut tx, &core, 3 + 2 * TIMER_64T1);
    assert!(seen.iter().all(|(_, b)| b == "SIP/2.0 500 by fulcrum"));
    let last = seen.last().map(|(t, _)| *t).unwrap_or(0);
    assert!(last < 3 + TIMER_64T1, "nothing after Timer H: {last}");
    // T1 + 2·T1 + 4·T1 = 3.5 s, then T2 until 32 s: 0.5, 1.5, 3.5, 7.5, ... 31.5.
    assert_eq!(seen.len(), 3 + 7);
    assert!(tx.is_finished(3 + TIMER_64T1));
}

/// Over a stream (or a WebSocket) the transport is reliable: no Timer G (§17.2.1).
#[test]
fn a_stream_client_gets_its_refusal_once() {
    let core = Core::new(3);
    let mut out = Vec::new();
    let sent = Bytes::from_static(b"INVITE attempt 0 to 0");
    let mut tx = Transaction::start(
        0,
        true,
        false,
        &params(),
        core.hop(0, sent),
        &core,
        &mut out,
    );
    respond_relayed(&mut tx, &core, 1, 0, 486);
    assert!(run_until(&mut tx, &core, 2 * TIMER_64T1).is_empty());
}

/// §17.2.2: every final the client was given, the best answer relayed after the tries
/// included, is sent again on each retransmission of the request; an INVITE answered 2xx
/// absorbs its retransmissions instead (RFC 6026 §7.1: the 2xx is the service's to repeat).
#[test]
fn every_final_is_sent_again_on_a_retransmission_but_an_invites_2xx() {
    let core = Core::new(5);
    // The best answer after the tries, relayed by fulcrum.
    let (mut tx, _) = start(&core, false);
    respond(&mut tx, &core, 1, 0, 503);
    respond(&mut tx, &core, 2, 1, 500);
    let out = respond(&mut tx, &core, 3, 2, 503);
    assert_eq!(to_client(&out), ["relayed SIP/2.0 500 from attempt 1"]);
    for t in [4, 5] {
        assert_eq!(
            to_client(&at(&mut tx, &core, t, Event::Retransmission)),
            ["relayed SIP/2.0 500 from attempt 1"]
        );
    }
    // A non-INVITE's 2xx, relayed, is sent again.
    let (mut tx, _) = start(&core, false);
    respond_relayed(&mut tx, &core, 1, 0, 202);
    assert_eq!(
        to_client(&at(&mut tx, &core, 2, Event::Retransmission)),
        ["relayed SIP/2.0 202 from attempt 0"]
    );
    // An INVITE's 2xx: absorbed; the service's own retransmission of it is relayed.
    let (mut tx, _) = start(&core, true);
    respond_relayed(&mut tx, &core, 1, 0, 200);
    assert!(to_client(&at(&mut tx, &core, 2, Event::Retransmission)).is_empty());
    assert_eq!(to_client(&respond(&mut tx, &core, 3, 0, 200)), ["relay"]);
    assert!(!tx.absorbs_ack(), "the ACK of a 2xx goes on end to end");
    assert!(
        run_until(&mut tx, &core, 2 * TIMER_64T1).is_empty(),
        "no Timer G for a 2xx"
    );
}

/// RFC 4320 §4.2: a transaction-stateful element never answers 408 to a non-INVITE; with
/// every service silent, the client's own Timer F ends it. And by default silence does not
/// move a non-INVITE (§4.1: a service may wait until T2 before its 100): only Timer F ends
/// the attempt, counted from its send.
#[test]
fn a_non_invite_no_service_answered_gets_no_408() {
    let core = Core::new(3);
    let (mut tx, _) = start(&core, false);
    let mut failed = 0;
    let mut now = 0;
    while let Some(t) = tx
        .poll_timeout()
        .filter(|&t| t <= 3 * TIMER_64T1 && !tx.is_finished(t))
    {
        now = t;
        let out = at(&mut tx, &core, now, Event::Timer);
        assert!(to_client(&out).is_empty(), "at {now}: {out:?}");
        assert!(
            to_members(&out).iter().all(|(m, _)| *m == 0),
            "no other service is tried: {out:?}"
        );
        failed += out
            .iter()
            .filter(|a| matches!(a, TxAction::Failed { code: None, .. }))
            .count();
    }
    assert_eq!(failed, 1, "Timer F reports the silent service once");
    assert_eq!(tx.attempts(), 1);
    assert!(tx.is_finished(now + TIMER_64T1));
    // With `no_answer_non_invite` set, silence moves it on; the last one still gets no 408.
    let mut p = params();
    p.no_answer_non_invite = Some(Duration::from_secs(4));
    let mut out = Vec::new();
    let first = core.hop(0, Bytes::from_static(b"MESSAGE"));
    let mut tx = Transaction::start(0, false, true, &p, first, &core, &mut out);
    let seen = run_until(&mut tx, &core, 3 * TIMER_64T1);
    assert!(seen.is_empty(), "{seen:?}");
    assert_eq!(tx.attempts(), 3);
}

/// §17.1.2.2: a non-INVITE attempt that answered 100 is still retransmitted, every T2,
/// until its final answer or Timer F from its send.
#[test]
fn a_proceeding_non_invite_is_retransmitted_every_t2_until_timer_f() {
    let core = Core::new(3);
    let (mut tx, _) = start(&core, false);
    at(&mut tx, &core, T1, Event::Timer);
    respond(&mut tx, &core, T1 + 1, 0, 100);
    let mut sends = Vec::new();
    while let Some(t) = tx
        .poll_timeout()
        .filter(|&t| t <= 2 * TIMER_64T1 && !tx.is_finished(t))
    {
        let out = at(&mut tx, &core, t, Event::Timer);
        if !to_members(&out).is_empty() {
            sends.push(t / MS);
        }
        assert!(to_client(&out).is_empty());
    }
    // At 1.5 s (Timer E as armed before the 100), then every 4 s, the last before 32 s.
    assert_eq!(sends[0], 1500);
    assert!(sends.windows(2).all(|w| w[1] - w[0] == 4000), "{sends:?}");
    assert_eq!(*sends.last().unwrap_or(&0), 29_500);
    assert_eq!(tx.attempts(), 1);
}

/// §16.7 step 2, §16.6 step 11: every 101-199 restarts Timer C, which is longer than three
/// minutes: a call that rings for five minutes is not cancelled.
#[test]
fn timer_c_is_restarted_by_every_provisional_and_exceeds_three_minutes() {
    const { assert!(TIMER_C > 180 * S) };
    let core = Core::new(3);
    let (mut tx, _) = start(&core, true);
    let mut now = S / 10;
    respond(&mut tx, &core, now, 0, 180);
    for _ in 0..5 {
        now += 60 * S;
        assert!(to_members(&at(&mut tx, &core, now, Event::Timer)).is_empty());
        let out = respond(&mut tx, &core, now, 0, 183);
        assert_eq!(to_client(&out), ["relay"]);
    }
    assert_eq!(tx.poll_timeout(), Some(now + TIMER_C));
    let out = respond_relayed(&mut tx, &core, now + S, 0, 200);
    assert_eq!(to_client(&out), ["relay"]);
    // A 100 does not restart it (it is hop by hop).
    let (mut tx, _) = start(&core, true);
    respond(&mut tx, &core, 1, 0, 180);
    respond(&mut tx, &core, 60 * S, 0, 100);
    assert_eq!(tx.poll_timeout(), Some(1 + TIMER_C));
}

/// By default `no_answer` (2 s) moves only INVITEs: a MESSAGE whose service is silent for
/// two seconds is still its.
#[test]
fn the_default_no_answer_moves_invites_only() {
    let core = Core::new(3);
    let d = Failover::default();
    assert_eq!(d.no_answer, Duration::from_secs(2));
    let mut out = Vec::new();
    let first = core.hop(0, Bytes::from_static(b"MESSAGE"));
    let mut tx = Transaction::start(0, false, true, &d, first, &core, &mut out);
    at(&mut tx, &core, 3 * S, Event::Timer);
    assert_eq!(tx.attempts(), 1);
    let first = core.hop(0, Bytes::from_static(b"INVITE"));
    let mut tx = Transaction::start(0, true, true, &d, first, &core, &mut out);
    at(&mut tx, &core, 2 * S - 1, Event::Timer);
    assert_eq!(tx.attempts(), 1, "not before 2 s");
    at(&mut tx, &core, 2 * S, Event::Timer);
    assert_eq!(tx.attempts(), 2);
}

/// §16.7 steps 5-6: a 6xx ends the search at once, from any attempt, and is what the client
/// gets; attempts still ringing are CANCELed, and no service is tried after it.
#[test]
fn a_6xx_ends_the_search_and_cancels_what_still_rings() {
    let core = Core::new(4);
    let (mut tx, _) = start(&core, true);
    // Attempt 0 silent past no_answer, attempt 1 rings, then attempt 0 answers 603.
    at(&mut tx, &core, S, Event::Timer);
    respond(&mut tx, &core, S + 1, 1, 180);
    let out = respond_relayed(&mut tx, &core, S + 2, 0, 603);
    assert_eq!(to_client(&out), ["relay"]);
    let sent = to_members(&out);
    assert!(
        sent.iter().any(|(m, b)| *m == 0 && b.starts_with("ACK of")),
        "{sent:?}"
    );
    assert!(
        sent.iter()
            .any(|(m, b)| *m == 1 && b.starts_with("CANCEL of")),
        "{sent:?}"
    );
    assert_eq!(tx.final_code(), Some(603));
    // Attempt 1's 487 is acknowledged and absorbed; nothing is tried after.
    let out = respond(&mut tx, &core, S + 3, 1, 487);
    assert!(to_client(&out).is_empty());
    run_until(&mut tx, &core, 2 * TIMER_64T1);
    assert_eq!(tx.attempts(), 2);
    // A 6xx even when listed in the codes (the config refuses it, this is the machine's own
    // guard) is not failed over.
    let mut p = params();
    p.codes.push(600);
    let mut out = Vec::new();
    let sent = Bytes::from_static(b"INVITE attempt 0 to 0");
    let mut tx = Transaction::start(0, true, true, &p, core.hop(0, sent), &core, &mut out);
    let out = respond_relayed(&mut tx, &core, 1, 0, 600);
    assert_eq!(to_client(&out), ["relay"]);
    assert_eq!(tx.attempts(), 1);
}

/// §16.7 step 10: the first 2xx CANCELs the other attempts still ringing; one that has not
/// rung yet is CANCELed when it does.
#[test]
fn a_2xx_cancels_the_other_attempts() {
    let core = Core::new(4);
    let (mut tx, _) = start(&core, true);
    at(&mut tx, &core, S, Event::Timer); // attempt 0 silent: attempt 1
    at(&mut tx, &core, 2 * S, Event::Timer); // attempt 1 silent: attempt 2
    respond(&mut tx, &core, 2 * S + 1, 1, 180); // attempt 1 rings late: CANCELed
    let out = respond_relayed(&mut tx, &core, 2 * S + 2, 2, 200);
    assert_eq!(to_client(&out), ["relay"]);
    let out = respond(&mut tx, &core, 2 * S + 3, 0, 180);
    assert!(
        to_members(&out)[0]
            .1
            .starts_with("CANCEL of INVITE attempt 0")
    );
    assert!(to_client(&out).is_empty());
}

proptest::proptest! {
    /// Whatever the services answer and whenever the timers fire, fulcrum gives the client at
    /// most one final answer of its own making, never relays a failover answer of an attempt
    /// it went on from, tries each service at most once and ends.
    #[test]
    fn one_final_answer_and_each_service_once(
        events in proptest::collection::vec((0u8..4, 0usize..8, 0u64..3000), 1..40),
        members in 1usize..6,
    ) {
        let core = Core::new(members);
        let (mut tx, _) = start(&core, true);
        let mut now = 0;
        let mut own_finals = 0;
        let codes = [180u16, 200, 486, 503, 500, 504, 183, 100];
        for (kind, pick, dt) in events {
            now += dt * MS;
            let out = match kind {
                0 => at(&mut tx, &core, now, Event::Timer),
                1 => {
                    let attempt = u8::try_from(pick % tx.attempts()).unwrap();
                    respond(&mut tx, &core, now, attempt, codes[pick])
                }
                2 => at(&mut tx, &core, now, Event::Retransmission),
                _ => at(&mut tx, &core, now, Event::Cancel),
            };
            if kind != 2 {
                own_finals += out.iter().filter(|a| matches!(a, TxAction::ToClient(b) if !b.starts_with(b"SIP/2.0 100"))).count();
            }
        }
        proptest::prop_assert!(own_finals <= 1);
        let mut seen: Vec<usize> = core.forwarded.borrow().iter().map(|&(_, m)| m).collect();
        seen.push(0);
        seen.sort_unstable();
        let n = seen.len();
        seen.dedup();
        proptest::prop_assert_eq!(seen.len(), n);
        proptest::prop_assert!(tx.attempts() <= 3);
        let mut guard = 0;
        while !tx.is_finished(now) && guard < 100 {
            now = tx.poll_timeout().unwrap_or(now + S).max(now + 1);
            at(&mut tx, &core, now, Event::Timer);
            guard += 1;
        }
        proptest::prop_assert!(tx.is_finished(now), "the transaction ends");
    }
}

/// An attempt its member's link could not take moves on at once, inside the transaction:
/// the client hears one final answer (the next service's), never fulcrum's 503 beside it.
#[test]
fn an_attempt_that_could_not_be_queued_moves_on_at_once() {
    let mut core = Core::new(3);
    core.streams = vec![0, 1, 2];
    let (mut tx, _) = start(&core, true);
    let out = at(&mut tx, &core, 1, Event::Unsent { attempt: 0 });
    assert_eq!(to_members(&out), [(1, "INVITE attempt 1 to 1".to_owned())]);
    // The link that could not take it charges its service, with its own cause.
    assert!(
        !out.iter().any(|a| matches!(a, TxAction::Failed { .. })),
        "{out:?}"
    );
    assert!(to_client(&out).is_empty());
    // A stale report (an earlier attempt) changes nothing.
    assert!(at(&mut tx, &core, 2, Event::Unsent { attempt: 0 }).is_empty());
    let out = respond_relayed(&mut tx, &core, 3, 1, 200);
    assert_eq!(to_client(&out), ["relay"]);
    // Every member unable to take it: the client gets 408 from the last, once.
    let (mut tx, _) = start(&core, true);
    at(&mut tx, &core, 1, Event::Unsent { attempt: 0 });
    at(&mut tx, &core, 2, Event::Unsent { attempt: 1 });
    let out = at(&mut tx, &core, 3, Event::Unsent { attempt: 2 });
    assert_eq!(to_client(&out), ["SIP/2.0 408 by fulcrum"]);
}

/// The code of a final as the test core writes it (`SIP/2.0 486 by fulcrum`, `relayed
/// SIP/2.0 486 from attempt 1`).
fn code_of(text: &str) -> Option<u16> {
    let rest = text.strip_prefix("relayed ").unwrap_or(text);
    rest.strip_prefix("SIP/2.0 ")?.get(..3)?.parse().ok()
}

proptest::proptest! {
    /// The duties toward both sides, over any interleaving of lost messages, client
    /// retransmissions and ACKs, CANCEL and service answers, with the shell firing every
    /// deadline as it passes: the client gets at most one non-2xx final and never one after a
    /// 2xx; every 2xx is relayed; every retransmission of a final is identical to it; over
    /// UDP a non-2xx final to an INVITE is sent again, at most T2 apart, until its ACK or
    /// Timer H; no service gets a new attempt after a 2xx or a 6xx.
    #[test]
    fn the_client_gets_one_story_and_every_final_until_acknowledged(
        events in proptest::collection::vec((0u8..5, 0usize..9, 0u64..4000), 1..50),
        members in 1usize..5,
        invite in proptest::bool::ANY,
    ) {
        let core = Core::new(members);
        let mut out = Vec::new();
        let sent = Bytes::from_static(b"INVITE attempt 0 to 0");
        let mut tx = Transaction::start(0, invite, true, &params(), core.hop(0, sent), &core, &mut out);
        let codes = [180u16, 200, 486, 503, 500, 603, 183, 100, 408];
        let mut now: Nanos = 0;
        // (time, code, bytes) of each final the client got, and the resends it got.
        let mut finals: Vec<(Nanos, u16, String)> = Vec::new();
        let mut resends: Vec<(Nanos, String, bool)> = Vec::new();
        let mut acked = false;
        let mut ended_search: Option<usize> = None;
        let record = |t: Nanos, out: &[TxAction], relayed: Option<(u16, String)>,
                          finals: &mut Vec<(Nanos, u16, String)>, resends: &mut Vec<(Nanos, String, bool)>| {
            let timer = relayed.is_none();
            for a in out {
                match a {
                    TxAction::ToClient(b) => {
                        let text = String::from_utf8_lossy(b).into_owned();
                        if let Some(c) = code_of(&text).filter(|&c| c >= 200) {
                            finals.push((t, c, text));
                        }
                    }
                    TxAction::Resend(b) => resends.push((t, String::from_utf8_lossy(b).into_owned(), timer)),
                    TxAction::Relay => {
                        if let Some((c, text)) = relayed.clone().filter(|(c, _)| *c >= 200) {
                            finals.push((t, c, text));
                        }
                    }
                    _ => {}
                }
            }
        };
        for (kind, pick, dt) in events {
            now += dt * MS;
            // The shell wakes the machine at every deadline that passed.
            while let Some(t) = tx.poll_timeout().filter(|&t| t <= now && !tx.is_finished(t)) {
                let out = at(&mut tx, &core, t, Event::Timer);
                record(t, &out, None, &mut finals, &mut resends);
            }
            if tx.is_finished(now) {
                // The shell removed the entry: what comes now is another transaction's.
                break;
            }
            match kind {
                0 => {}
                1 => {
                    let attempt = u8::try_from(pick % tx.attempts()).unwrap_or(0);
                    let code = codes[pick];
                    let before = tx.is_answered();
                    let out = respond(&mut tx, &core, now, attempt, code);
                    let text = format!("relayed SIP/2.0 {code} from attempt {attempt}");
                    if code >= 200 && out.contains(&TxAction::Relay) {
                        tx.relayed(Bytes::from(text.clone()));
                    }
                    record(now, &out, Some((code, text)), &mut finals, &mut resends);
                    if ended_search.is_none() && (code >= 600 || (200..300).contains(&code)) && (!before || code < 300) {
                        ended_search = Some(core.forwarded.borrow().len());
                    }
                }
                2 => {
                    let out = at(&mut tx, &core, now, Event::Retransmission);
                    record(now, &out, Some((0, String::new())), &mut finals, &mut resends);
                }
                3 => {
                    let out = at(&mut tx, &core, now, Event::Cancel);
                    record(now, &out, Some((0, String::new())), &mut finals, &mut resends);
                }
                _ => {
                    // The client ACKs a non-2xx final once it has one (its ACK may be lost:
                    // only odd picks arrive).
                    if finals.first().is_some_and(|f| f.1 >= 300) && pick % 2 == 1 {
                        at(&mut tx, &core, now, Event::Ack);
                        acked = true;
                    }
                }
            }
        }
        while let Some(t) = tx.poll_timeout().filter(|&t| !tx.is_finished(t)) {
            let out = at(&mut tx, &core, t, Event::Timer);
            record(t, &out, None, &mut finals, &mut resends);
            proptest::prop_assert!(t < now + 10 * TIMER_C, "the transaction ends");
        }
        let non_2xx: Vec<_> = finals.iter().filter(|f| f.1 >= 300).collect();
        proptest::prop_assert!(non_2xx.len() <= 1, "{finals:?}");
        if let Some(first_2xx) = finals.iter().find(|f| f.1 < 300) {
            proptest::prop_assert!(non_2xx.iter().all(|f| f.0 <= first_2xx.0), "{finals:?}");
        }
        if let Some(first) = finals.first() {
            for (t, r, _) in &resends {
                if *t > first.0 {
                    proptest::prop_assert_eq!(r, &first.2);
                }
            }
            if invite && first.1 >= 300 && !acked {
                let after: Vec<Nanos> = resends.iter().filter(|r| r.0 > first.0 && r.2).map(|r| r.0).collect();
                proptest::prop_assert_eq!(after.first().copied(), Some(first.0 + T1), "{:?}", resends);
                proptest::prop_assert!(after.windows(2).all(|w| w[1] - w[0] <= T2), "{after:?} {finals:?}");
                let last = after.last().copied().unwrap_or(0);
                proptest::prop_assert!(last + T2 >= first.0 + TIMER_64T1, "until Timer H: {after:?}");
            }
        }
        if let Some(n) = ended_search {
            proptest::prop_assert_eq!(core.forwarded.borrow().len(), n, "no attempt after a 2xx or 6xx");
        }
    }
}
