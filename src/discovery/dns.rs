//! Resolving the DNS sources: A/AAAA records of `NAME` (one replica per
//! address, on the source's port) and SRV records (host and port per
//! replica), through the system's resolver or the one the source names.
//! An answer carries how long it stays valid (the shortest record TTL), so
//! the caller re-resolves no later than that.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use hickory_resolver::config::{LookupIpStrategy, NameServerConfig, ResolverConfig, ResolverOpts};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::net::NetError;
use hickory_resolver::proto::rr::RData;
use hickory_resolver::Resolver;

use super::source::replica_name;
use crate::fleet::ReplicaSpec;

/// One DNS answer: the replicas it names, and how long it is valid.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub replicas: Vec<ReplicaSpec>,
    pub valid_for: Duration,
}

/// A resolver: the system's, or the server at `at` (tests, or a cluster's DNS).
pub fn resolver(at: Option<SocketAddr>, timeout: Duration) -> Result<Resolver<TokioRuntimeProvider>, String> {
    let mut options = ResolverOpts::default();
    options.timeout = timeout;
    options.attempts = 1;
    // Answers are re-read on an interval: a cached answer would hide a
    // scale-down for as long as its TTL, which is the source's own business.
    options.cache_size = 0;
    // One address family per answer: a dual-stack pod has an A and an AAAA
    // record, and both would be two replicas on one engine (hickory's
    // default asks for both). IPv4 when there is any, else IPv6.
    options.ip_strategy = LookupIpStrategy::Ipv4thenIpv6;
    let builder = match at {
        Some(addr) => {
            let mut server = NameServerConfig::udp(addr.ip());
            for c in &mut server.connections {
                c.port = addr.port();
            }
            Resolver::builder_with_config(
                ResolverConfig::from_name_servers(vec![server]),
                TokioRuntimeProvider::default(),
            )
        }
        None => Resolver::builder_tokio().map_err(|e| format!("the system resolver: {e}"))?,
    };
    builder.with_options(options).build().map_err(|e| format!("cannot build a resolver: {e}"))
}

/// A/AAAA records of `name`: one replica per address, `http://ADDR:PORT`.
/// No record is an answer with no replicas (the lifecycle holds a sudden
/// empty answer); a server that does not answer is an error.
pub async fn resolve_addresses(r: &Resolver<TokioRuntimeProvider>, name: &str, port: u16) -> Result<Answer, String> {
    let found = r.lookup_ip(fqdn(name)).await.map(|found| {
        let replicas = found.iter().map(|ip| {
            ReplicaSpec::new(&replica_name(&ip.to_string(), port), &format!("http://{}:{port}", url_host(ip)))
        });
        answer(replicas, found.valid_until())
    });
    taken(name, found)
}

/// SRV records of `name`: one replica per target and port, named after
/// them. Each target is resolved through the same resolver, so the replica's
/// URL holds its address (a target the resolver cannot resolve keeps its
/// name, for the system's resolver to try at connect time).
pub async fn resolve_srv(r: &Resolver<TokioRuntimeProvider>, name: &str) -> Result<Answer, String> {
    let found = match r.srv_lookup(fqdn(name)).await {
        Ok(found) => found,
        Err(e) => return taken(name, Err(e)),
    };
    let targets: Vec<(String, u16)> = found
        .answers()
        .iter()
        .filter_map(|record| match &record.data {
            RData::SRV(srv) => Some((srv.target.to_utf8().trim_end_matches('.').to_string(), srv.port)),
            _ => None,
        })
        .collect();
    let addresses = futures_util::future::join_all(targets.iter().map(|(host, _)| r.lookup_ip(fqdn(host)))).await;
    let replicas = targets.iter().zip(addresses).map(|((host, port), address)| {
        let at = address.ok().and_then(|a| a.iter().next()).map_or_else(|| host.clone(), url_host);
        ReplicaSpec::new(&replica_name(host, *port), &format!("http://{at}:{port}"))
    });
    Ok(answer(replicas, found.valid_until()))
}

fn url_host(ip: std::net::IpAddr) -> String {
    match ip {
        std::net::IpAddr::V4(v4) => v4.to_string(),
        std::net::IpAddr::V6(v6) => format!("[{v6}]"),
    }
}

/// The replicas of one answer, each name once, in a stable order.
fn answer(replicas: impl Iterator<Item = ReplicaSpec>, valid_until: Instant) -> Answer {
    let mut replicas: Vec<ReplicaSpec> = replicas.collect();
    replicas.sort_by(|a, b| a.id.cmp(&b.id));
    replicas.dedup_by(|a, b| a.id == b.id);
    Answer { replicas, valid_for: valid_until.saturating_duration_since(Instant::now()) }
}

/// A lookup's outcome: no records is an empty answer, anything else an error.
fn taken(name: &str, found: Result<Answer, NetError>) -> Result<Answer, String> {
    match found {
        Err(e) if e.is_no_records_found() => Ok(Answer { replicas: Vec::new(), valid_for: Duration::ZERO }),
        other => other.map_err(|e| format!("{name}: {e}")),
    }
}

/// Names are looked up as given, not under the host's search domains.
fn fqdn(name: &str) -> String {
    if name.ends_with('.') {
        name.to_string()
    } else {
        format!("{name}.")
    }
}
