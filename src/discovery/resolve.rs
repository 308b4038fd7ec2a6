//! The lookups behind [`crate::discovery`]: hickory-resolver asks the configured servers
//! (or the system's, from `/etc/resolv.conf`), with its cache off so that every refresh is
//! a real question, and its answer becomes an [`Outcome`]. IO.

use super::{Outcome, Pool, Target};
use crate::config::{DnsKind, DnsName, DnsSettings};
use hickory_resolver::TokioResolver;
use hickory_resolver::config::{NameServerConfig, ResolverConfig};
use hickory_resolver::net::NetError;
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::rr::{RData, RecordType};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// How long one server is given to answer, and how many times it is asked.
const TIMEOUT: Duration = Duration::from_secs(2);
const ATTEMPTS: usize = 2;

/// A resolver for `s`: its servers (each over UDP, then TCP for truncated answers), or the
/// system's configuration when it names none.
pub fn resolver(s: &DnsSettings) -> Result<TokioResolver, String> {
    let mut b = if s.servers.is_empty() {
        TokioResolver::builder_tokio()
            .map_err(|e| format!("the system's resolver configuration: {e}"))?
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

/// The addresses of `name` (A and AAAA), with their TTLs (none when the name or its
/// address records do not exist).
async fn addresses(r: &TokioResolver, name: &str) -> Result<Vec<(IpAddr, u32)>, String> {
    let a = ask(r, name, RecordType::A, |d| match d {
        RData::A(a) => Some(IpAddr::V4(a.0)),
        _ => None,
    });
    let aaaa = ask(r, name, RecordType::AAAA, |d| match d {
        RData::AAAA(a) => Some(IpAddr::V6(a.0)),
        _ => None,
    });
    let (a, aaaa) = tokio::join!(a, aaaa);
    // A failure of either keeps the last set: half an answer is not an answer.
    let (mut found, more) = (a?, aaaa?);
    found.extend(more);
    Ok(found)
}

/// Ask what `dns` names now.
pub async fn lookup(r: &TokioResolver, dns: &DnsName) -> Outcome {
    match dns.kind {
        DnsKind::Host { port } => match addresses(r, &dns.name).await {
            Err(e) => Outcome::Failed(e),
            Ok(found) if found.is_empty() => Outcome::Empty,
            Ok(found) => Outcome::Found {
                ttl: found.iter().map(|f| f.1).min().unwrap_or(0),
                targets: found
                    .into_iter()
                    .map(|(ip, _)| Target {
                        addr: SocketAddr::new(ip, port),
                        priority: 0,
                        weight: 0,
                    })
                    .collect(),
            },
        },
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
    let mut ttl = u32::MAX;
    let mut targets = Vec::new();
    for ((priority, weight, port, target), rttl) in records {
        ttl = ttl.min(rttl);
        // A target without addresses is no member (the others still are).
        let found = match addresses(r, &target).await {
            Err(e) => return Outcome::Failed(format!("{target}: {e}")),
            Ok(found) => found,
        };
        for (ip, attl) in found {
            ttl = ttl.min(attl);
            targets.push(Target {
                addr: SocketAddr::new(ip, port),
                priority,
                weight,
            });
        }
    }
    if targets.is_empty() {
        return Outcome::Empty;
    }
    Outcome::Found { targets, ttl }
}

/// Log what a lookup says where it changes something: members added or removed, the start
/// and the end of an outage.
pub fn log_outcome(service: &str, p: &Pool, outcome: &Outcome) {
    let name = p.dns.name.trim_end_matches('.');
    match outcome {
        Outcome::Failed(why) if p.failing_since.is_none() => tracing::warn!(
            service,
            name,
            error = %why,
            kept = p.members.len(),
            "DNS lookup failed; the pool keeps the members of its last answer"
        ),
        Outcome::Failed(_) => {}
        _ if p.failing_since.is_some() => {
            tracing::info!(service, name, "DNS lookups answer again");
        }
        _ => {}
    }
    let members: Vec<std::net::SocketAddr> = match outcome {
        Outcome::Found { targets, .. } => targets.iter().map(|t| t.addr).collect(),
        Outcome::Empty => Vec::new(),
        Outcome::Failed(_) => return,
    };
    let before: Vec<std::net::SocketAddr> = p.members.iter().map(|t| t.addr).collect();
    let added: Vec<String> = members
        .iter()
        .filter(|a| !before.contains(a))
        .map(ToString::to_string)
        .collect();
    let mut removed: Vec<String> = before
        .iter()
        .filter(|a| !members.contains(a))
        .map(ToString::to_string)
        .collect();
    removed.dedup();
    if !added.is_empty() || !removed.is_empty() || !p.answered {
        tracing::info!(service, name, added = ?added, removed = ?removed, empty = matches!(outcome, Outcome::Empty), "DNS pool changed");
    }
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
                log_outcome(&service, p, &outcome);
                p.record(outcome, now, &file.dns);
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
        let all = names.iter().map(|(service, dns)| {
            let r = &r;
            async move {
                let o = tokio::time::timeout(TIMEOUT * 3, lookup(r, dns))
                    .await
                    .unwrap_or_else(|_| Outcome::Failed("timed out".to_owned()));
                (service.clone(), o)
            }
        });
        futures_util::future::join_all(all).await
    })
}
