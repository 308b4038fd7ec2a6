//! Whether this instance should be sent new traffic: the verdict of `GET /readyz`, which a
//! VIP (keepalived) or an anycast route (BIRD, ExaBGP) follows (docs/deployment.md). PURE:
//! facts about the vservers and the drain flag in, a verdict out.
//!
//! Ready means every vserver is bound and has a service a new flow could be given (UP, not
//! out of service), and no graceful stop has begun. A service at its `max_clients` limit
//! still counts: being full is load, not failure, and withdrawing a full instance would
//! push its load onto the others.

/// What readiness needs to know of one running vserver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct VserverFacts {
    pub name: String,
    /// It holds its listening sockets.
    pub is_bound: bool,
    /// Its services that are UP and not out of service.
    pub usable_services: usize,
}

/// The verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    Ready,
    /// Ready, with things the operator should know that do not stop this instance from
    /// serving (a pool kept from a DNS answer that can no longer be refreshed: every
    /// instance sees the same outage, and withdrawing them all would help no one).
    ReadyWith(Vec<String>),
    /// Why not, one line per reason, the drain first.
    NotReady(Vec<String>),
}

impl Readiness {
    pub fn is_ready(&self) -> bool {
        !matches!(self, Readiness::NotReady(_))
    }

    /// The verdict with `notes` added: beside a ready one, or after the reasons of one
    /// that is not.
    pub fn with_notes(self, notes: Vec<String>) -> Readiness {
        match self {
            _ if notes.is_empty() => self,
            Readiness::Ready => Readiness::ReadyWith(notes),
            Readiness::ReadyWith(mut n) => {
                n.extend(notes);
                Readiness::ReadyWith(n)
            }
            Readiness::NotReady(mut r) => {
                r.extend(notes);
                Readiness::NotReady(r)
            }
        }
    }
}

/// The verdict for `vservers` (`None`: the proxy has stopped) while `is_draining` (a
/// SIGTERM's graceful stop has begun: new flows get 503, so the instance must be taken out
/// of rotation from its first moment).
pub(crate) fn readiness(vservers: Option<&[VserverFacts]>, is_draining: bool) -> Readiness {
    let mut reasons = Vec::new();
    if is_draining {
        reasons.push("draining".to_owned());
    }
    match vservers {
        None => reasons.push("stopped".to_owned()),
        Some(vs) => reasons.extend(vs.iter().filter_map(vserver_problem)),
    }
    if reasons.is_empty() {
        Readiness::Ready
    } else {
        Readiness::NotReady(reasons)
    }
}

fn vserver_problem(v: &VserverFacts) -> Option<String> {
    if !v.is_bound {
        Some(format!("vserver {}: not bound", v.name))
    } else if v.usable_services == 0 {
        Some(format!("vserver {}: no usable service", v.name))
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(name: &str, is_bound: bool, usable_services: usize) -> VserverFacts {
        VserverFacts {
            name: name.to_owned(),
            is_bound,
            usable_services,
        }
    }

    #[test]
    fn ready_when_every_vserver_is_bound_and_can_take_a_flow() {
        let vs = [facts("sip-lb", true, 1), facts("web", true, 3)];
        assert_eq!(readiness(Some(&vs), false), Readiness::Ready);
        assert!(readiness(Some(&[]), false).is_ready());
    }

    #[test]
    fn every_vserver_without_a_usable_service_is_a_reason() {
        let vs = [
            facts("sip-lb", true, 0),
            facts("web", true, 2),
            facts("dns", false, 1),
        ];
        assert_eq!(
            readiness(Some(&vs), false),
            Readiness::NotReady(vec![
                "vserver sip-lb: no usable service".to_owned(),
                "vserver dns: not bound".to_owned(),
            ])
        );
    }

    #[test]
    fn draining_is_never_ready_and_comes_first() {
        let vs = [facts("sip-lb", true, 2)];
        assert_eq!(
            readiness(Some(&vs), true),
            Readiness::NotReady(vec!["draining".to_owned()])
        );
        let vs = [facts("sip-lb", true, 0)];
        let Readiness::NotReady(reasons) = readiness(Some(&vs), true) else {
            panic!("not ready");
        };
        assert_eq!(reasons[0], "draining");
        assert_eq!(reasons.len(), 2);
    }

    #[test]
    fn a_stopped_proxy_is_not_ready() {
        assert_eq!(
            readiness(None, false),
            Readiness::NotReady(vec!["stopped".to_owned()])
        );
    }
}
