//! Where replicas are found: the sources a gateway is pointed at, and
//! reading the file source (the DNS ones resolve through a resolver, next).
//!
//! - `dns://NAME:PORT[?resolver=IP:PORT]`: A/AAAA records, one replica per
//!   address (a Kubernetes headless Service lists its ready pods this way);
//! - `dns+srv://_SERVICE._PROTO.NAME[?resolver=IP:PORT]`: SRV records give
//!   host and port per replica (Kubernetes named ports, Consul);
//! - `file://PATH`: the same `[[replicas]]` tables the config file uses,
//!   re-read when the file changes (Slurm, Ray, anything that writes a file).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::fleet::ReplicaSpec;

/// A discovery source, parsed from its URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Dns { name: String, port: u16, resolver: Option<SocketAddr> },
    Srv { name: String, resolver: Option<SocketAddr> },
    File { path: PathBuf },
}

impl Source {
    pub fn parse(url: &str) -> Result<Source, String> {
        let bad = |why: &str| format!("discovery source '{url}': {why}");
        if let Some(path) = url.strip_prefix("file://") {
            if path.is_empty() {
                return Err(bad("file:// needs a path"));
            }
            return Ok(Source::File { path: PathBuf::from(path) });
        }
        let (scheme, rest) = url.split_once("://").ok_or_else(|| bad("expected dns://, dns+srv:// or file://"))?;
        let (target, query) = rest.split_once('?').unwrap_or((rest, ""));
        let mut resolver = None;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("resolver", addr)) => {
                    resolver = Some(addr.parse().map_err(|_| bad("resolver must be IP:PORT"))?);
                }
                _ => return Err(bad(&format!("unknown parameter '{pair}' (only resolver=IP:PORT)"))),
            }
        }
        match scheme {
            "dns" => {
                let (name, port) = target.rsplit_once(':').ok_or_else(|| bad("dns:// needs NAME:PORT"))?;
                let port = port.parse().map_err(|_| bad("the port must be a number from 1 to 65535"))?;
                if name.is_empty() || port == 0 {
                    return Err(bad("dns:// needs NAME:PORT"));
                }
                Ok(Source::Dns { name: name.to_string(), port, resolver })
            }
            "dns+srv" => {
                if !target.starts_with('_') || target.split('.').count() < 3 {
                    return Err(bad("dns+srv:// needs _SERVICE._PROTO.NAME"));
                }
                Ok(Source::Srv { name: target.to_string(), resolver })
            }
            other => Err(bad(&format!("unknown scheme '{other}'"))),
        }
    }

    /// How the source names itself in the API and events: `dns:NAME:PORT`,
    /// `dns+srv:NAME`, `file:PATH`.
    pub fn label(&self) -> String {
        match self {
            Source::Dns { name, port, .. } => format!("dns:{name}:{port}"),
            Source::Srv { name, .. } => format!("dns+srv:{name}"),
            Source::File { path } => format!("file:{}", path.display()),
        }
    }
}

/// A replica's name from a DNS answer: the host (SRV target, or the
/// address) and the port, lowercased and made a valid replica id
/// (`[a-z0-9_-]`, at most 64), so it is stable across answers and readable.
pub fn replica_name(host: &str, port: u16) -> String {
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    let mut name: String = format!("{host}-{port}")
        .chars()
        .map(|c| if c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_' { c } else { '-' })
        .collect();
    if name.len() > 64 {
        // Keep the distinctive ends: the start of the host and the port.
        let tail = format!("-{port}");
        name.truncate(64 - tail.len());
        name.push_str(&tail);
    }
    name
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplicasFile {
    #[serde(default)]
    replicas: Vec<ReplicaSpec>,
}

/// Reads a file source: `[[replicas]]` tables as in the config file, every
/// one valid and no id twice, or an error that leaves the fleet as it is.
pub fn read_file(path: &Path) -> Result<Vec<ReplicaSpec>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    parse_file(&text).map_err(|e| format!("{}: {e}", path.display()))
}

fn parse_file(text: &str) -> Result<Vec<ReplicaSpec>, String> {
    let file: ReplicasFile = toml::from_str(text).map_err(|e| e.message().to_string())?;
    let mut seen = std::collections::BTreeSet::new();
    for (i, r) in file.replicas.iter().enumerate() {
        r.validate().map_err(|e| format!("replicas[{i}]: {e}"))?;
        if !seen.insert(r.id.clone()) {
            return Err(format!("replicas[{i}].id: duplicate replica id '{}'", r.id));
        }
    }
    Ok(file.replicas)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_parse_with_their_resolver_and_bad_ones_say_why() {
        assert_eq!(
            Source::parse("dns://engines.default.svc.cluster.local:8000").unwrap(),
            Source::Dns { name: "engines.default.svc.cluster.local".into(), port: 8000, resolver: None }
        );
        assert_eq!(
            Source::parse("dns+srv://_http._tcp.engines?resolver=127.0.0.1:5353").unwrap(),
            Source::Srv { name: "_http._tcp.engines".into(), resolver: Some("127.0.0.1:5353".parse().unwrap()) }
        );
        assert_eq!(
            Source::parse("file:///etc/engines.toml").unwrap(),
            Source::File { path: "/etc/engines.toml".into() }
        );
        assert_eq!(Source::parse("dns://e:8000").unwrap().label(), "dns:e:8000");
        for (bad, says) in [
            ("dns://engines", "NAME:PORT"),
            ("dns://engines:0", "NAME:PORT"),
            ("dns://engines:http", "port"),
            ("dns+srv://engines", "_SERVICE._PROTO.NAME"),
            ("dns://e:1?resolver=localhost", "IP:PORT"),
            ("dns://e:1?ttl=5", "unknown parameter"),
            ("consul://e", "unknown scheme"),
            ("file://", "path"),
            ("engines:8000", "expected"),
        ] {
            let e = Source::parse(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn names_are_stable_readable_and_valid_replica_ids() {
        assert_eq!(
            replica_name("Engine-0.Engines.default.svc.cluster.local.", 8000),
            "engine-0-engines-default-svc-cluster-local-8000"
        );
        assert_eq!(replica_name("10.0.0.5", 8000), "10-0-0-5-8000");
        let long = replica_name(&"a".repeat(100), 30000);
        assert_eq!(long.len(), 64);
        assert!(long.ends_with("-30000"));
        for name in [long, replica_name("fe80::1", 80)] {
            crate::fleet::validate_id(&name).unwrap();
        }
    }

    #[test]
    fn a_file_source_reads_replica_tables_and_refuses_a_malformed_one_whole() {
        let good = r#"
            [[replicas]]
            id = "node-7"
            url = "http://127.0.0.2:8000"
            max_large_inflight = 1

            [[replicas]]
            id = "node-8"
            url = "http://127.0.0.3:8000"
            kv_tokens = 122636
        "#;
        let found = parse_file(good).unwrap();
        assert_eq!(found.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(), ["node-7", "node-8"]);
        assert_eq!((found[0].max_large_inflight, found[1].kv_tokens), (Some(1), Some(122_636)));
        assert!(parse_file("").unwrap().is_empty(), "an empty file lists no replicas (the lifecycle holds that)");
        for bad in [
            "[[replicas]]\nid = \"x\"",                         // no url
            "[[replicas]]\nid = \"X Y\"\nurl = \"http://a:1\"", // bad id
            "[[replicas]]\nid = \"a\"\nurl = \"http://a:1\"\n[[replicas]]\nid = \"a\"\nurl = \"http://b:1\"", // twice
            "[[replicas]]\nid = \"a\"\nurl = \"http://a:1\"\nspeed = 3", // unknown key
            "[[replicas]\nid = ",                               // truncated mid-write
        ] {
            assert!(parse_file(bad).is_err(), "{bad}");
        }
        let missing = read_file(Path::new("/nonexistent/engines.toml")).unwrap_err();
        assert!(missing.contains("cannot read"), "{missing}");
    }
}
