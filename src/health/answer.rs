//! How a `sip-options` monitor reads the final answer to its OPTIONS. PURE: status code,
//! Retry-After and the monitor's `expect_codes` in, an [`Outcome`] out.
//!
//! Without `expect_codes`:
//! - **5xx means not alive**: the service failed to process the request (RFC 3261 §21.5); a
//!   503 says it is unavailable (§21.5.4), and with a Retry-After (§20.33) for how long:
//!   [`Outcome::Unavailable`], which holds the service DOWN ([`super::state`]).
//! - **408 means not alive**: the service could not answer in time (§21.4.9), so what it needs
//!   to work is not working.
//! - **Any other final answer means alive**: 2xx, 3xx, 4xx other than 408 and 6xx come from a
//!   UAS that received, parsed and processed the request (§8.2); a service that answers
//!   OPTIONS 404 or 405 (it takes no OPTIONS) is a working one.
//!
//! With `expect_codes` only the codes listed mean alive; a 503 with a Retry-After that is not
//! listed still holds the service DOWN for the Retry-After.

use super::state::Outcome;

/// The header a 503 carries its Retry-After in (RFC 3261 §20.33; it has no compact form).
pub const RETRY_AFTER_HEADER: &[u8] = b"Retry-After";

/// The outcome of a probe answered `code`, with `retry_after_s` the answer's Retry-After in
/// seconds (when it has one that parses), for a monitor accepting `expect_codes` (the
/// default rule when empty).
pub fn judge(code: u16, retry_after_s: Option<u32>, expect_codes: &[u16]) -> Outcome {
    let alive = if expect_codes.is_empty() {
        is_alive_by_default(code)
    } else {
        expect_codes.contains(&code)
    };
    match (alive, code, retry_after_s) {
        (true, _, _) => Outcome::Alive,
        (false, 503, Some(retry_after_s)) => Outcome::Unavailable { retry_after_s },
        _ => Outcome::Dead,
    }
}

/// Whether a final answer `code` means alive when the monitor lists no `expect_codes`.
pub fn is_alive_by_default(code: u16) -> bool {
    matches!(code, 200..=499 | 600..=699) && code != 408
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sip::parse_retry_after;
    use proptest::prelude::*;

    #[test]
    fn by_default_5xx_and_408_are_not_alive() {
        for code in [500, 502, 503, 504, 513, 580, 599, 408] {
            assert_eq!(judge(code, None, &[]), Outcome::Dead, "{code}");
        }
        for code in [
            200, 202, 299, 301, 302, 380, 400, 401, 403, 404, 405, 407, 480, 486,
        ] {
            assert_eq!(judge(code, None, &[]), Outcome::Alive, "{code}");
        }
        for code in [600, 603, 604, 606, 699] {
            assert_eq!(judge(code, None, &[]), Outcome::Alive, "{code}");
        }
        assert_eq!(judge(180, None, &[]), Outcome::Dead, "not a final answer");
    }

    #[test]
    fn a_503_with_retry_after_is_unavailable_for_that_long() {
        assert_eq!(
            judge(503, Some(120), &[]),
            Outcome::Unavailable { retry_after_s: 120 }
        );
        assert_eq!(
            judge(503, Some(0), &[]),
            Outcome::Unavailable { retry_after_s: 0 }
        );
        // Only a 503 holds: Retry-After on other answers (§20.33 allows it on 404, 413,
        // 480, 486, 500, 600, 603) changes nothing.
        assert_eq!(judge(500, Some(30), &[]), Outcome::Dead);
        assert_eq!(judge(486, Some(30), &[]), Outcome::Alive);
        assert_eq!(judge(603, Some(30), &[]), Outcome::Alive);
    }

    #[test]
    fn expect_codes_override_the_default() {
        assert_eq!(judge(200, None, &[200]), Outcome::Alive);
        assert_eq!(judge(404, None, &[200]), Outcome::Dead);
        assert_eq!(judge(503, None, &[200, 503]), Outcome::Alive);
        assert_eq!(judge(503, Some(5), &[200, 503]), Outcome::Alive);
        assert_eq!(judge(408, None, &[408]), Outcome::Alive);
        assert_eq!(
            judge(503, Some(5), &[200]),
            Outcome::Unavailable { retry_after_s: 5 },
            "a 503 not listed still holds"
        );
    }

    #[test]
    fn retry_after_values() {
        for (v, want) in [
            (&b"120"[..], Some(120)),
            (b" 18000;duration=3600", Some(18000)),
            (b"120 (I'm in a meeting)", Some(120)),
            (b"120(busy)", Some(120)),
            (b"5 ;duration=10", Some(5)),
            (b"0", Some(0)),
            (b"99999999999999", Some(u32::MAX)),
            (b"4294967296", Some(u32::MAX)),
            (b"", None),
            (b"   ", None),
            (b"-5", None),
            (b"5s", None),
            (b"abc", None),
            (b"Fri, 31 Dec 1999 23:59:59 GMT", None),
        ] {
            assert_eq!(
                parse_retry_after(v),
                want,
                "{:?}",
                String::from_utf8_lossy(v)
            );
        }
    }

    proptest! {
        /// Any bytes: no panic; when a value parses, it is the leading digits, saturated.
        #[test]
        fn retry_after_never_panics(v in proptest::collection::vec(any::<u8>(), 0..40)) {
            if let Some(n) = parse_retry_after(&v) {
                let digits: String = v
                    .iter()
                    .skip_while(|b| b.is_ascii_whitespace())
                    .take_while(|b| b.is_ascii_digit())
                    .map(|&b| char::from(b))
                    .collect();
                let want = digits.parse::<u64>().map_or(u32::MAX, |x| u32::try_from(x).unwrap_or(u32::MAX));
                prop_assert_eq!(n, want);
            }
        }

        /// Without `expect_codes`, exactly 5xx and 408 among final answers are not alive, and
        /// only a 503 with Retry-After holds.
        #[test]
        fn default_rule(code in 200u16..700, ra in proptest::option::of(any::<u32>())) {
            let o = judge(code, ra, &[]);
            let dead = (500..600).contains(&code) || code == 408;
            prop_assert_eq!(o.is_alive(), !dead);
            prop_assert_eq!(
                matches!(o, Outcome::Unavailable { .. }),
                code == 503 && ra.is_some()
            );
        }
    }
}
