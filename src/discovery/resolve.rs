//! The lookups behind [`crate::discovery`]: hickory-resolver asks the configured servers
//! (or the system's, from `/etc/resolv.conf`), with its cache off so that every refresh is
//! a real question, and its answer becomes an [`Outcome`]. IO.

use super::{Family, Outcome, Part, Pool};
use crate::config::{DnsKind, DnsName, DnsSettings};
use hickory_resolver::TokioResolver;
use hickory_resolver::config::{NameServerConfig, ResolverConfig};
use hickory_resolver::net::NetError;
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::rr::{RData, RecordType};
use std::net::IpAddr;
use std::time::Duration;

/// At most this many names are asked at once (each with its A and AAAA, or an SRV name
/// with its targets): a config with hundreds of pools does not fire them all at its server.
pub const LOOKUPS_AT_ONCE: usize = 16;

/// How long one server is given to answer, and how many times it is asked.
const TIMEOUT: Duration = Duration::from_secs(2);
const ATTEMPTS: usize = 2;

/// A resolver for `s`: its servers (each over UDP, then TCP for truncated answers), or the
/// system's configuration (`s.resolv_conf`) when it names none.
pub fn resolver(s: &DnsSettings) -> Result<TokioResolver, String> {
    let mut b = if s.servers.is_empty() {
        let text = std::fs::read(&s.resolv_conf)
            .map_err(|e| format!("reading {}: {e}", s.resolv_conf.display()))?;
        let (config, options) = hickory_resolver::system_conf::parse_resolv_conf(&text)
            .map_err(|e| format!("{}: {e}", s.resolv_conf.display()))?;
        let mut b = TokioResolver::builder_with_config(config, TokioRuntimeProvider::default());
        // Its options (ndots, search, ...); the cache, timeout and attempts are set below.
        *b.options_mut() = options;
        b
    } else {
        let servers = s
            .servers
            .iter()
            .map(|a| {
                let mut ns = NameServerConfig::udp_and_tcp(a.ip());
                for c in &mut ns.connections {
                    c.port = a.port();
                }
                ns
            })
            .collect();
        TokioResolver::builder_with_config(
            ResolverConfig::from_name_servers(servers),
            TokioRuntimeProvider::default(),
        )
    };
    let o = b.options_mut();
    o.cache_size = 0;
    o.timeout = TIMEOUT;
    o.attempts = ATTEMPTS;
    b.build().map_err(|e| format!("building the resolver: {e}"))
}

/// One record type's answer: the records (value, TTL), none (NXDOMAIN / NODATA: `Ok`
/// empty), or a failure.
type Answer<T> = Result<Vec<(T, u32)>, String>;

async fn ask<T>(
    r: &TokioResolver,
    name: &str,
    rtype: RecordType,
    pick: impl Fn(&RData) -> Option<T>,
) -> Answer<T> {
    match r.lookup(name, rtype).await {
        Ok(l) => Ok(l
            .answers()
            .iter()
            .filter_map(|rec| pick(&rec.data).map(|v| (v, rec.ttl)))
            .collect()),
        Err(e) if e.is_no_records_found() => Ok(Vec::new()),
        Err(e) => Err(describe(&e)),
    }
}

fn describe(e: &NetError) -> String {
    let s = e.to_string();
    if s.is_empty() { format!("{e:?}") } else { s }
}

/// The A and the AAAA records of `name` as two parts of an answer, asked at once: one
/// failing costs nothing of the other ([`super::Pool::record`] keeps its last addresses).
/// AAAA addresses this host has no route to are left out ([`routable`]).
async fn address_parts(
    r: &TokioResolver,
    name: &str,
    srv: (u16, u16, u16),
    key: &str,
) -> [Part; 2] {
    let a = ask(r, name, RecordType::A, |d| match d {
        RData::A(a) => Some(IpAddr::V4(a.0)),
        _ => None,
    });
    let aaaa = ask(r, name, RecordType::AAAA, |d| match d {
        RData::AAAA(a) => Some(IpAddr::V6(a.0)),
        _ => None,
    });
    let (a, mut aaaa) = tokio::join!(a, aaaa);
    if let Ok(found) = &mut aaaa {
        let before = found.len();
        found.retain(|(ip, _)| routable(*ip));
        if found.len() < before {
            tracing::debug!(
                name,
                skipped = before - found.len(),
                "AAAA records skipped: this host has no route to them"
            );
        }
    }
    let part = |family, answer: Answer<IpAddr>| Part {
        key: (key.to_owned(), family),
        srv,
        answer: answer.map(|found| {
            let ttl = found.iter().map(|f| f.1).min().unwrap_or(0);
            (found.into_iter().map(|f| f.0).collect(), ttl)
        }),
    };
    [part(Family::V4, a), part(Family::V6, aaaa)]
}

/// Whether this host has a route to `ip`: a UDP socket connected toward it (no packet is
/// sent) says so. An AAAA member on a host without IPv6 routes (common on IPv4-only hosts
/// whose DNS publishes both families) would only be a member every connection to fails.
fn routable(ip: IpAddr) -> bool {
    let any: IpAddr = match ip {
        IpAddr::V4(_) => std::net::Ipv4Addr::UNSPECIFIED.into(),
        IpAddr::V6(_) => std::net::Ipv6Addr::UNSPECIFIED.into(),
    };
    std::net::UdpSocket::bind((any, 0))
        .and_then(|s| s.connect((ip, 9)))
        .is_ok()
}

/// What says that the system's resolver configuration changed: its file's identity, size
/// and modification time (`None`: unreadable, or not used because `s` names servers).
pub fn system_conf_stamp(s: &DnsSettings) -> Option<(u64, u64, std::time::SystemTime)> {
    use std::os::unix::fs::MetadataExt;
    if !s.servers.is_empty() {
        return None;
    }
    let m = std::fs::metadata(&s.resolv_conf).ok()?;
    Some((m.ino(), m.len(), m.modified().ok()?))
}

/// Ask what `dns` names now.
pub async fn lookup(r: &TokioResolver, dns: &DnsName) -> Outcome {
    match dns.kind {
        DnsKind::Host { port } => {
            let parts = address_parts(r, &dns.name, (0, 0, port), "").await;
            // NXDOMAIN / NODATA on both: the name has no addresses.
            if parts
                .iter()
                .all(|p| p.answer.as_ref().is_ok_and(|(ips, _)| ips.is_empty()))
            {
                return Outcome::Empty;
            }
            Outcome::Parts(parts.into())
        }
        DnsKind::Srv => srv(r, &dns.name).await,
    }
}

async fn srv(r: &TokioResolver, name: &str) -> Outcome {
    let records = ask(r, name, RecordType::SRV, |d| match d {
        RData::SRV(s) => Some((s.priority, s.weight, s.port, s.target.to_ascii())),
        _ => None,
    })
    .await;
    let records = match records {
        Err(e) => return Outcome::Failed(e),
        Ok(r) => r,
    };
    // RFC 2782: a single record with target "." says the service is not offered there.
    let records: Vec<_> = records
        .into_iter()
        .filter(|((_, _, port, target), _)| target != "." && *port != 0)
        .collect();
    if records.is_empty() {
        return Outcome::Empty;
    }
    // Every target at once (a slow one does not hold the others up), each its own parts: a
    // target whose name fails keeps its last addresses, the others are what they say. A
    // target named twice (two ports) is asked twice, each its own part.
    let asks = records
        .iter()
        .map(|((priority, weight, port, target), rttl)| {
            let key = format!("{target} {port}");
            async move {
                let mut parts = address_parts(r, target, (*priority, *weight, *port), &key).await;
                // The SRV record's own TTL bounds its addresses'.
                for p in &mut parts {
                    if let Ok((_, ttl)) = &mut p.answer {
                        *ttl = (*ttl).min(*rttl);
                    }
                }
                parts
            }
        });
    let parts: Vec<Part> = futures_util::future::join_all(asks)
        .await
        .into_iter()
        .flatten()
        .collect();
    Outcome::Parts(parts)
}

/// Take `outcome` into `p` at `now` ([`Pool::record`]) and log what it changed: members added
/// or removed, parts that failed, the start and the end of an outage. Whether the members
/// changed.
pub fn record_logged(
    service: &str,
    p: &mut Pool,
    outcome: Outcome,
    now: crate::stats::Nanos,
    s: &DnsSettings,
) -> bool {
    let was_failing = p.failing_since.is_some();
    let was_answered = p.answered;
    let before: Vec<std::net::SocketAddr> = p.members.iter().map(|t| t.addr).collect();
    let empty = matches!(outcome, Outcome::Empty);
    let changed = p.record(outcome, now, s);
    let name = p.dns.name.trim_end_matches('.');
    match (&p.failing_since, was_failing) {
        (Some(_), false) => tracing::warn!(
            service,
            name,
            error = p.last_error.as_deref().unwrap_or(""),
            kept = p.members.len(),
            "DNS lookup failed; the pool keeps the members of its last answer"
        ),
        (None, true) => tracing::info!(service, name, "DNS lookups answer again"),
        _ => {}
    }
    if let Some(partial) = &p.partial {
        tracing::warn!(service, name, failed = %partial, "part of the DNS answer failed; those parts keep their last addresses");
    }
    let after: Vec<std::net::SocketAddr> = p.members.iter().map(|t| t.addr).collect();
    let added: Vec<String> = after
        .iter()
        .filter(|a| !before.contains(a))
        .map(ToString::to_string)
        .collect();
    let removed: Vec<String> = before
        .iter()
        .filter(|a| !after.contains(a))
        .map(ToString::to_string)
        .collect();
    if changed || (!was_answered && p.answered) {
        tracing::info!(service, name, added = ?added, removed = ?removed, empty, "DNS pool changed");
    }
    changed
}

/// `file` as it runs now: its pools looked up ([`at_start`]) and expanded into their
/// members, and the pools with what their lookups said. `now` is the runtime clock's.
pub fn resolved(
    file: &crate::config::Config,
    now: crate::stats::Nanos,
) -> (crate::config::Config, super::Pools) {
    let mut pools = super::Pools::default();
    pools.sync(file, now);
    if !pools.by_service.is_empty() {
        for (service, outcome) in at_start(&file.dns, &pools.due(now)) {
            if let Some(p) = pools.by_service.get_mut(&service) {
                record_logged(&service, p, outcome, now, &file.dns);
            }
        }
    }
    (super::expand(file, &pools.members()), pools)
}

/// Look up every name of `names` at once, on a runtime of its own (fulcrum's has not started
/// yet): the first member sets, before the vservers start. Bounded: a name not answered by
/// then is a failure, asked again by the running proxy.
pub fn at_start(s: &DnsSettings, names: &[(String, DnsName)]) -> Vec<(String, Outcome)> {
    let failed = |why: String| {
        names
            .iter()
            .map(|(n, _)| (n.clone(), Outcome::Failed(why.clone())))
            .collect()
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return failed(format!("no runtime for the lookups: {e}")),
    };
    rt.block_on(async {
        let r = match resolver(s) {
            Ok(r) => r,
            Err(e) => return failed(e),
        };
        use futures_util::StreamExt;
        let all = names.iter().map(|(service, dns)| {
            let r = &r;
            async move {
                let o = tokio::time::timeout(TIMEOUT * 3, lookup(r, dns))
                    .await
                    .unwrap_or_else(|_| Outcome::Failed("timed out".to_owned()));
                (service.clone(), o)
            }
        });
        futures_util::stream::iter(all)
            .buffer_unordered(LOOKUPS_AT_ONCE)
            .collect()
            .await
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Loopback is always routable; an IPv6 address with no route (none of the host's
    /// routes covers the discard prefix 100::/64 of RFC 6666 unless it is configured so) is not,
    /// unless this host routes it, which the test then checks through `ip -6 route get`.
    #[test]
    fn loopback_is_routable_and_an_unrouted_address_is_not() {
        assert!(routable("127.0.0.1".parse().expect("ip")));
        let v6_loopback: IpAddr = "::1".parse().expect("ip");
        let has_v6 = std::net::UdpSocket::bind("[::1]:0").is_ok();
        assert_eq!(routable(v6_loopback), has_v6);
        let discard: IpAddr = "100::1".parse().expect("ip");
        let routed = std::process::Command::new("ip")
            .args(["-6", "route", "get", "100::1"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        assert_eq!(routable(discard), routed);
    }
}
