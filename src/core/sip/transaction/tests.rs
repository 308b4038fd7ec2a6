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
}

fn params() -> Failover {
    Failover::default()
}

fn start(core: &Core, invite: bool) -> (Transaction, Vec<TxAction>) {
    let mut out = Vec::new();
    let sent = Bytes::from_static(b"INVITE attempt 0 to 0");
    let tx = Transaction::start(0, invite, &params(), core.hop(0, sent), core, &mut out);
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
            TxAction::ToClient(b) | TxAction::RelayStored(b) => {
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
        member: 0,
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
        member: 0,
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
    assert_eq!(to_client(&out), ["SIP/2.0 500 from attempt 1"]);
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
    assert!(out.contains(&TxAction::Answered { member: 0 }));
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
    // A failover code after the CANCEL: no next attempt, the client gets the best answer.
    let out = respond(&mut tx, &core, 3, 0, 503);
    assert_eq!(tx.attempts(), 1);
    assert_eq!(to_client(&out), ["SIP/2.0 500 by fulcrum"]);
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
    p.no_answer = Duration::from_secs(20);
    let mut out = Vec::new();
    let first = core.hop(0, Bytes::from_static(b"MESSAGE"));
    let mut tx = Transaction::start(0, false, &p, first, &core, &mut out);
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
